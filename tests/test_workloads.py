"""--model's three forms: built-in names, hf:<model_type>, and the user's own factory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from remat.cli import main
from remat.workloads import WorkloadError, _hf_batch, build_hf, load

ROOT = Path(__file__).resolve().parents[1]
SMALL_GPT2 = "hf:gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=128,n_positions=32"


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out


def test_hf_model_profiles_from_the_command_line(capsys, tmp_path):
    rc, out = _run(capsys, ["profile", "--model", SMALL_GPT2, "--batch-size", "2", "--out", str(tmp_path), "--json"])
    assert rc == 0, out.err
    summary = json.loads(out.out)
    assert summary["model"] == SMALL_GPT2 and summary["num_activations"] > 0
    assert summary["peak_bytes_measured"] > summary["persistent_bytes"]


@pytest.mark.parametrize("factory", ["build", "build_muon"])
def test_factory_runs_bitwise_from_the_command_line(capsys, monkeypatch, factory):
    """`build_muon` hands over two optimizers as a list."""
    monkeypatch.chdir(ROOT)  # the factory is found next to the user, as `python -m` would
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    rc, out = _run(capsys, ["run", "--model", f"examples.tiny_factory:{factory}", "--batch-size", "512", "--budget", "0.75",
                            "--check", "--json", "--pairs", "1", "--steps", "2"])
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert result["grads_match"] is True and result["num_recomputed"] > 0
    assert result["peak_bytes_measured"] == result["predicted_peak_bytes"]
    # A call's host time before its graph runs, apart from the graph's.
    assert 0 < result["call_guards_seconds"] and 0 < result["call_inputs_seconds"] and 0 < result["call_host_warm_seconds"]
    assert result["call_host_seconds"] + result["graph_seconds"] == pytest.approx(result["iteration_seconds"])
    assert result["back_to_back_seconds"] > result["call_host_seconds"]  # whole steps: the host's part and the graph


@pytest.mark.parametrize(
    "model,message",
    [
        ("gpt5", "unknown model 'gpt5'; use one of mlp"),
        ("hf:no_such_type", "has no model type 'no_such_type'"),
        ("hf:gpt2:n_layer", "config fields are key=value"),
        # A width the heads do not divide: transformers' own error, named with the model it broke
        ("hf:bert:num_hidden_layers=1,hidden_size=30,num_attention_heads=4", "transformers could not build BertForMaskedLM from this config"),
        ("hf:funnel:block_sizes=1", "transformers could not build a funnel config from these fields"),
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz' for --model no_such_module_xyz:build: ModuleNotFoundError"),
        ("examples.tiny_factory:nothing", "examples.tiny_factory has no function 'nothing'"),
    ],
)
def test_bad_models_are_named(capsys, monkeypatch, model, message):
    monkeypatch.chdir(ROOT)
    rc, out = _run(capsys, ["profile", "--model", model, "--batch-size", "2"])
    assert rc == 2 and message in out.err, out.err


def test_factory_results_are_checked(tmp_path, monkeypatch):
    (tmp_path / "bad_factory.py").write_text(
        "import torch\n"
        "def three(batch_size):\n    return torch.nn.Linear(2, 2), None, torch.zeros(batch_size, 2)\n"
        "def not_a_module(batch_size):\n    return 1, None, torch.zeros(batch_size, 2), print\n"
        "def raises(batch_size):\n    raise RuntimeError('no data here')\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkloadError, match=r"must return \(model, optimizer, batch, train_step\)"):
        load("bad_factory:three", 2)
    with pytest.raises(WorkloadError, match="returned a int as the model, not a torch.nn.Module"):
        load("bad_factory:not_a_module", 2)
    with pytest.raises(WorkloadError, match="the factory bad_factory:raises failed: RuntimeError: no data here"):
        load("bad_factory:raises", 2)


@pytest.mark.parametrize("spec,head", [("bert:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64", "MaskedLM"),
                                       ("vit:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,image_size=32,patch_size=8", "ImageClassification"),
                                       # transformers lists two image heads for DeiT (with and without its teacher): the first is built
                                       ("xlnet:n_layer=1,d_model=32,n_head=2,d_inner=64,vocab_size=128", "LMHead"),  # no position limit (-1)
                                       ("deit:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,image_size=32,patch_size=8", "DeiTForImageClassification"),
                                       # list fields, in brackets
                                       ("convnext:num_stages=2,depths=[1,1],hidden_sizes=[16,32],image_size=32", "ConvNextForImageClassification")])
def test_hf_heads_and_batches(spec, head):
    model, batch = build_hf(spec, 2)
    assert head in type(model).__name__ and model.training
    assert torch.isfinite(model(**batch).loss)



def test_a_model_of_two_towers_gets_the_batch_of_its_image_tower():
    """CLIP's image head (`hf:clip`): the image size and channels are its vision config's
    (the top-level config has none)."""
    from transformers import CLIPConfig, CLIPForImageClassification

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = CLIPConfig(vision_config=vision, problem_type="single_label_classification")
    batch = _hf_batch(config, "image", 2, torch.Generator().manual_seed(0))
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert torch.isfinite(CLIPForImageClassification(config)(**batch).loss)

def test_config_fields_parse_numbers_words_and_lists_with_or_without_quotes():
    from remat.workloads import _config_overrides

    assert _config_overrides("depths=[1,1],attn_layers=[local,'lsh'],scale=0.5,tie=false,act=gelu,pad=None,shape=(2,[3,x])") == {
        "depths": [1, 1], "attn_layers": ["local", "lsh"], "scale": 0.5, "tie": False, "act": "gelu", "pad": None,
        "shape": (2, [3, "x"])}


def test_a_config_field_with_an_unclosed_bracket_is_refused_by_name():
    with pytest.raises(WorkloadError, match=r"config field depths: '\[1,2' has an unclosed bracket"):
        build_hf("convnext:depths=[1,2", 2)
    with pytest.raises(WorkloadError, match=r"a list in brackets: depths=\[1,1\]\); got 'depths'"):
        build_hf("convnext:depths", 2)


def test_a_hugging_face_mixture_of_experts_runs_bitwise_from_the_command_line(capsys):
    # hf: loads MoE layers as batched matmuls (the default grouped matmul cannot be traced in
    # float32). Their weight gradients accumulate through index_put, whose CPU kernel is
    # nondeterministic: eager differs from itself unless deterministic kernels are asked for.
    spec = ("hf:mixtral:num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
            "num_key_value_heads=1,vocab_size=64,num_local_experts=4,num_experts_per_tok=2")
    try:
        rc, out = _run(capsys, ["run", "--model", spec, "--batch-size", "2", "--budget", "0.75", "--check", "--json",
                                "--pairs", "1", "--steps", "1", "--optimizer", "adamw", "--deterministic"])
    finally:
        torch.use_deterministic_algorithms(False)
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert result["grads_match"] is True and result["num_recomputed"] > 0
    assert result["peak_bytes_measured"] == result["predicted_peak_bytes"]


def test_eager_differing_from_itself_is_told_apart():
    from remat.measurement.check import eager_differs_from_itself
    from remat.models import make_train_step

    model, batch = torch.nn.Linear(4, 4), torch.randn(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    assert eager_differs_from_itself(step, model, opt, batch) == []
    calls = []

    def drifting(m, o, b):  # a step whose result depends on how often it ran
        calls.append(1)
        return step(m, o, b * len(calls))

    found = eager_differs_from_itself(drifting, model, opt, batch)
    assert found and all(m.startswith(("parameter", "gradient", "optimizer state")) for m in found)
