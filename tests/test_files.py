"""Hostile and broken plan.json / profile.json files: each is refused with a PlanError that
says what does not match, and nothing in a file is ever unpickled or evaluated.

Every case runs on both kinds of file, saved by `remat plan` for mlp-deep (batch 512) and
then broken the way a crash, an editor or a mix-up would. Cases already covered on
synthetic graphs (tests/test_planners.py `test_plan_json_errors`, tests/test_profiler.py
`test_broken_profile_files_are_refused`) are checked here on real saved files, with the
full message.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from remat.errors import PlanError
from remat.planners.plan import Plan
from remat.profile.profiles import Profile

KINDS = ("plan", "profile")
MODEL, BATCH = "mlp-deep", 512


class _Hostile:
    """Unpickling this opens (creates) `marker`: proof that a loader ran code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _graph(model: str, batch_size: int):
    from remat.memory.analysis import analyze
    from remat.cli.common import build_and_capture
    from remat.memory.schedule import GraphIndex

    _, _, tg, _ = build_and_capture(model, batch_size, "sgd", "cpu", 0)
    return tg, GraphIndex.build(tg, analyze(tg))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """plan.json and profile.json as `remat plan` writes them, and the graph they belong to."""
    from remat.cli.plan import plan_command

    out = tmp_path_factory.mktemp("saved")
    result = plan_command(MODEL, BATCH, "0.85", out_dir=out, runs=1, progress=False)
    assert result["plan"].num_recomputed > 0
    tg, index = _graph(MODEL, BATCH)
    return {"plan": out / "plan.json", "profile": out / "profile.json", "tg": tg, "index": index}


def _load(kind: str, path: Path):
    return Plan.from_json(path) if kind == "plan" else Profile.from_json(path)


def _use(kind: str, path: Path, saved, tg=None, index=None, model=MODEL, batch_size=BATCH):
    """Load a file and check it against a graph, the way `remat` does before using it."""
    if kind == "plan":
        plan = Plan.from_json(path)
        return plan.dropped(index if index is not None else saved["index"])
    from remat.profile.profiler import load_profile_for

    return load_profile_for(path, tg if tg is not None else saved["tg"], model, batch_size, "sgd")


def _doc(saved, kind: str) -> dict:
    return json.loads(saved[kind].read_text())


def _write(tmp_path: Path, kind: str, content) -> Path:
    path = tmp_path / f"{kind}.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


FORMAT = {"plan": "remat.plan", "profile": "remat.profile"}


def test_saved_files_load_and_match_their_graph(saved):
    # The intact files are accepted: every refusal below is due to the damage alone.
    for kind in KINDS:
        _use(kind, saved[kind], saved)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_file_is_refused(saved, tmp_path, kind):
    text = saved[kind].read_text()
    path = _write(tmp_path, kind, text[: len(text) // 2])
    with pytest.raises(PlanError, match=rf"{re.escape(str(path))} is truncated: its JSON ends before it is complete .*expected a {FORMAT[kind]} file"):
        _load(kind, path)
    path = _write(tmp_path, kind, "")
    with pytest.raises(PlanError, match=rf"{re.escape(str(path))} is empty; expected a {FORMAT[kind]} file"):
        _load(kind, path)


@pytest.mark.parametrize("kind", KINDS)
def test_not_json_is_refused(saved, tmp_path, kind):
    path = _write(tmp_path, kind, "planner: mutwo\nbudget: 0.85\n")  # YAML, say
    with pytest.raises(PlanError, match=rf"{re.escape(str(path))} is not a JSON file \(Expecting value at line 1\); expected a {FORMAT[kind]} file"):
        _load(kind, path)
    path = _write(tmp_path, kind, [_doc(saved, kind)])
    with pytest.raises(PlanError, match=rf"holds a JSON list, not a {FORMAT[kind]} object"):
        _load(kind, path)
    path = _write(tmp_path, kind, b"\xff\xfe\x00binary\x00")
    with pytest.raises(PlanError, match=rf"is not a text file \(not UTF-8\); expected a {FORMAT[kind]} JSON file"):
        _load(kind, path)
    with pytest.raises(PlanError, match=rf"{re.escape(str(tmp_path))} is a directory, not a {FORMAT[kind]} file"):
        _load(kind, tmp_path)
    with pytest.raises(PlanError, match="no such file"):
        _load(kind, tmp_path / "missing.json")


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_infinity_are_refused(saved, tmp_path, kind):
    # Python's json reads NaN and Infinity, which are not JSON: a remat file never has them.
    doc = _doc(saved, kind)
    doc["predicted_overhead_seconds" if kind == "plan" else "iteration_seconds"] = "@@"
    for constant in ("NaN", "Infinity", "-Infinity"):
        path = _write(tmp_path, kind, json.dumps(doc).replace('"@@"', constant))
        with pytest.raises(PlanError, match=rf"^{re.escape(str(path))} holds {constant}, which is not JSON"):
            _load(kind, path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL, "torch.save"])
def test_pickle_is_refused_and_never_unpickled(saved, tmp_path, kind, protocol):
    # The payload is real: unpickling it creates its marker file.
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Hostile(control), protocol=2))
    assert control.exists()

    marker = tmp_path / "marker"
    payload = {"format": FORMAT[kind], "version": 1, "evil": _Hostile(marker)}
    path = tmp_path / f"{kind}.json"
    if protocol == "torch.save":
        torch.save(payload, path)
        expected = rf"{re.escape(str(path))} is a zip archive \(torch\.save output\?\), not a JSON file: remat never unpickles"
    else:
        path.write_bytes(pickle.dumps(payload, protocol=protocol))
        expected = (
            rf"{re.escape(str(path))} is a Python pickle, not a JSON file: remat never unpickles"
            if protocol >= 2
            else rf"{re.escape(str(path))} is not a JSON file"  # protocol 0 is text
        )
    with pytest.raises(PlanError, match=expected):
        _load(kind, path)
    with pytest.raises(PlanError, match=expected):
        _use(kind, path, saved)
    assert not marker.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_format_tag_is_refused(saved, tmp_path, kind):
    other = "profile" if kind == "plan" else "plan"
    # The other kind of remat file passed by mistake.
    path = _write(tmp_path, kind, _doc(saved, other))
    with pytest.raises(PlanError, match=rf"is a '{FORMAT[other]}' file; expected \"format\": '{FORMAT[kind]}'"):
        _load(kind, path)
    doc = _doc(saved, kind)
    del doc["format"]
    path = _write(tmp_path, kind, doc)
    with pytest.raises(PlanError, match=rf"has no \"format\" field; expected \"format\": '{FORMAT[kind]}'"):
        _load(kind, path)


@pytest.mark.parametrize("kind", KINDS)
def test_future_version_is_refused(saved, tmp_path, kind):
    path = _write(tmp_path, kind, {**_doc(saved, kind), "version": 2})
    with pytest.raises(PlanError, match=rf"is {FORMAT[kind]} version 2, but this remat reads version 1: the file was written by a newer remat\. Upgrade remat"):
        _load(kind, path)
    for bad in ("1", True, 1.0, None):  # equal to 1 in Python, but not the version 1
        path = _write(tmp_path, kind, {**_doc(saved, kind), "version": bad})
        with pytest.raises(PlanError, match=rf"is {FORMAT[kind]} version {re.escape(repr(bad))}, but this remat reads version 1"):
            _load(kind, path)


@pytest.mark.parametrize("kind", KINDS)
def test_missing_field_is_refused(saved, tmp_path, kind):
    doc = _doc(saved, kind)
    del doc["fingerprint"]
    path = _write(tmp_path, kind, doc)
    prefix = re.escape(str(path)) if kind == "plan" else rf"malformed remat profile {re.escape(str(path))}"
    with pytest.raises(PlanError, match=rf"{prefix}: missing the field\(s\) fingerprint; was it written by this version of remat\?"):
        _load(kind, path)
    doc = _doc(saved, kind)
    entries = "recomputed" if kind == "plan" else "nodes"
    field = "nbytes" if kind == "plan" else "seconds"
    del doc[entries][1][field]
    path = _write(tmp_path, kind, doc)
    with pytest.raises(PlanError, match=rf"{prefix}: {entries}\[1\] is missing the field\(s\) {field}"):
        _load(kind, path)
    doc = _doc(saved, kind)
    doc["pickled_state"] = "gASVAAAAAAAAAAB9lC4="  # an unknown field is refused, not ignored
    path = _write(tmp_path, kind, doc)
    with pytest.raises(PlanError, match=rf"{prefix}: unknown field\(s\) pickled_state"):
        _load(kind, path)


# (kind, where to put the bad value, the value, the message)
WRONG_TYPES = [
    ("plan", ["budget_bytes"], "9 MiB", r"budget_bytes must be a non-negative integer, not the string '9 MiB'"),
    ("plan", ["predicted_peak_bytes"], -1, r"predicted_peak_bytes must be a non-negative integer, not -1"),
    ("plan", ["budget_bytes"], 9939404.5, r"budget_bytes must be a non-negative integer, not 9939404\.5"),
    ("plan", ["batch_size"], True, r"batch_size must be a positive integer or null, not true"),
    ("plan", ["batch_size"], 0, r"batch_size must be a positive integer or null, not 0"),
    ("plan", ["planning_seconds"], "fast", r"planning_seconds must be a non-negative number, not the string 'fast'"),
    ("plan", ["share_rebuilt"], "yes", r"share_rebuilt must be true or false, not the string 'yes'"),
    ("plan", ["meta"], [], r"meta must be an object, not a list"),
    ("plan", ["recomputed"], {}, r"recomputed must be a list, not an object"),
    ("plan", ["recomputed", 0, "nbytes"], -524288, r"recomputed\[0\]\.nbytes must be a non-negative integer, not -524288"),
    ("plan", ["recomputed", 0, "ops"], "addmm_4", r"recomputed\[0\]\.ops must be a list, not the string 'addmm_4'"),
    ("plan", ["recomputed", 0, "ops", 0], 7, r"recomputed\[0\]\.ops\[0\] must be a string, not 7"),
    ("plan", ["recomputed", 0, "key"], None, r"recomputed\[0\]\.key must be a string, not null"),
    ("plan", ["fingerprint"], "d33ac34b", r"fingerprint must be a sha256 digest \(64 hexadecimal digits\), not the string 'd33ac34b'"),
    ("profile", ["persistent_bytes"], "5 MiB", r"persistent_bytes must be a non-negative integer, not the string '5 MiB'"),
    ("profile", ["simulated_peak_bytes"], -10765312, r"simulated_peak_bytes must be a non-negative integer, not -10765312"),
    ("profile", ["tensors", 2, "nbytes"], -1, r"tensors\[2\]\.nbytes must be a non-negative integer, not -1"),
    ("profile", ["tensors", 2, "persistent"], 1, r"tensors\[2\]\.persistent must be true or false, not 1"),
    ("profile", ["nodes", 3, "seconds"], "0.001", r"nodes\[3\]\.seconds must be a non-negative number, not the string '0\.001'"),
    ("profile", ["nodes", 3, "seconds"], -0.5, r"nodes\[3\]\.seconds must be a non-negative number, not -0\.5"),
    ("profile", ["nodes", 3, "name"], ["addmm"], r"nodes\[3\]\.name must be a string, not a list"),
    ("profile", ["timeline", "activation", 5], "x", r'timeline\["activation"\]\[5\] must be a non-negative integer, not the string \'x\''),
    ("profile", ["phase_bounds", "forward"], [0], r'phase_bounds\["forward"\] must be a list of 2 items, not a list of 1'),
    ("profile", ["peak_breakdown", "activation"], -4194304, r'peak_breakdown\["activation"\] must be a non-negative integer, not -4194304'),
    ("profile", ["runs"], 0, r"runs must be a positive integer, not 0"),
    ("profile", ["batch_size"], "512", r"batch_size must be a positive integer or null, not the string '512'"),
    ("profile", ["fingerprint"], 12345, r"fingerprint must be a string, not 12345"),
]


def _set(doc, where, value):
    for k in where[:-1]:
        doc = doc[k]
    doc[where[-1]] = value


@pytest.mark.parametrize("kind,where,value,message", WRONG_TYPES, ids=[f"{k}-{'.'.join(map(str, w))}-{v!r}" for k, w, v, _ in WRONG_TYPES])
def test_wrong_field_type_is_refused(saved, tmp_path, kind, where, value, message):
    doc = _doc(saved, kind)
    _set(doc, where, value)
    path = _write(tmp_path, kind, doc)
    prefix = re.escape(str(path)) if kind == "plan" else rf"malformed remat profile {re.escape(str(path))}"
    with pytest.raises(PlanError, match=rf"^{prefix}: {message}$"):
        _load(kind, path)


def test_edited_plan_entry_is_refused(saved, tmp_path):
    doc = _doc(saved, "plan")
    kept = doc["recomputed"][0]["key"]
    # A recomputed tensor renamed to one this graph does not have: the file is well
    # formed, so it loads; using it for this graph is refused, naming the tensor.
    doc["recomputed"][0]["key"] = "no_such_tensor"
    path = _write(tmp_path, "plan", doc)
    plan = Plan.from_json(path)
    with pytest.raises(PlanError, match=r"the plan names 1 tensor\(s\) this graph does not have \(no_such_tensor\): it was made for another graph \(mlp-deep, batch 512\)"):
        plan.dropped(saved["index"])
    # The same tensor listed twice; the count edited.
    doc = _doc(saved, "plan")
    doc["recomputed"][1]["key"] = kept
    path = _write(tmp_path, "plan", doc)
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: recomputed\[1\] repeats the tensor {kept} of recomputed\[0\]$"):
        Plan.from_json(path)
    doc = _doc(saved, "plan")
    doc["num_recomputed"] += 1
    path = _write(tmp_path, "plan", doc)
    with pytest.raises(PlanError, match=rf"num_recomputed is {doc['num_recomputed']} but {doc['num_recomputed'] - 1} entries are listed"):
        Plan.from_json(path)


def test_edited_profile_entry_is_refused(saved, tmp_path):
    prefix = "malformed remat profile "
    # A node renamed to one this graph does not have: the same ops (fingerprint), so it
    # loads; using it for this graph is refused, naming the node.
    doc = _doc(saved, "profile")
    old = doc["nodes"][5]["name"]
    doc["nodes"][5]["name"] = "no_such_node"
    path = _write(tmp_path, "profile", doc)
    Profile.from_json(path)
    with pytest.raises(
        PlanError,
        match=rf"{re.escape(str(path))}: this profile's node 5 is no_such_node \(aten\.\w+\.default, forward\), but this graph's node 5 "
        rf"is {old} \(aten\.\w+\.default, forward\): the profile was edited, or measured on another graph",
    ):
        _use("profile", path, saved)
    # A node removed: the file no longer agrees with itself.
    doc = _doc(saved, "profile")
    n_nodes = len(doc["nodes"])
    del doc["nodes"][5]
    path = _write(tmp_path, "profile", doc)
    with pytest.raises(PlanError, match=rf"{prefix}{re.escape(str(path))}: timeline\[\"parameter\"\] has {n_nodes} entries, but the profile has {n_nodes - 1} nodes"):
        Profile.from_json(path)
    # Two nodes with one name; a phase or a role that does not exist; bounds past the end.
    edits = [
        (["nodes", 6, "name"], old, rf"nodes\[6\] repeats the name {old} of nodes\[5\]"),
        (["nodes", 6, "phase"], "sideways", r"nodes\[6\]\.phase is 'sideways', not one of forward, backward, optimizer"),
        (["tensors", 3, "role"], "weights", r"tensors\[3\]\.role is 'weights', not one of parameter, gradient, activation, optimizer_state, input, other"),
        (["phase_bounds", "optimizer"], [125, 900], rf'phase_bounds\["optimizer"\] is \[125, 900\], not within the {n_nodes} nodes'),
        (["tensors", 3, "created"], n_nodes, rf"tensors\[3\]\.created is {n_nodes}, outside the {n_nodes} nodes"),
        (["peak_rank"], n_nodes, rf"peak_rank is {n_nodes}, outside the {n_nodes} nodes"),
        (["timeline", "weights"], [0] * n_nodes, r"timeline has the role\(s\) weights, not one of parameter, gradient, activation, optimizer_state, input, other"),
    ]
    for where, value, message in edits:
        doc = _doc(saved, "profile")
        _set(doc, where, value)
        path = _write(tmp_path, "profile", doc)
        with pytest.raises(PlanError, match=rf"^{prefix}{re.escape(str(path))}: {message}$"):
            Profile.from_json(path)


@pytest.fixture(scope="module")
def other_graphs():
    return {"batch": _graph(MODEL, 256), "model": _graph("mlp", 512)}


def test_plan_for_another_graph_is_refused(saved, tmp_path, other_graphs):
    fp = _doc(saved, "plan")["fingerprint"]
    # The same model at another batch size: the same tensor names, another fingerprint.
    tg, index = other_graphs["batch"]
    from remat.profile.profiles import graph_fingerprint

    other_fp = graph_fingerprint(tg)
    with pytest.raises(
        PlanError,
        match=rf"this plan was made for another graph \(mlp-deep, batch 512\) \(fingerprint {fp[:12]}…, this graph {other_fp[:12]}…\): "
        "the model, optimizer or batch shape differ",
    ):
        _use("plan", saved["plan"], saved, index=index)
    # Another model: it has none of the plan's tensors (or another fingerprint).
    tg, index = other_graphs["model"]
    with pytest.raises(PlanError, match=r"(this graph does not have|made for another graph) .*\(mlp-deep, batch 512\)"):
        _use("plan", saved["plan"], saved, index=index)
    # Without its model and batch size, the fingerprint alone still refuses it.
    doc = _doc(saved, "plan")
    doc.update(model=None, batch_size=None, optimizer=None)
    path = _write(tmp_path, "plan", doc)
    with pytest.raises(PlanError, match=rf"this plan was made for another graph \(fingerprint {fp[:12]}…, this graph {other_fp[:12]}…\)"):
        _use("plan", path, saved, index=other_graphs["batch"][1])


def test_profile_for_another_graph_is_refused(saved, tmp_path, other_graphs):
    path = saved["profile"]
    fp = _doc(saved, "profile")["fingerprint"]
    # Asked for another batch size / model / optimizer: refused by what the file says it is.
    tg, _ = other_graphs["batch"]
    with pytest.raises(
        PlanError,
        match=rf"{re.escape(str(path))} is a profile of mlp-deep with batch size 512 \(sgd\), not of mlp-deep with batch size 256 \(sgd\): its batch size differs",
    ):
        _use("profile", path, saved, tg=tg, batch_size=256)
    tg, _ = other_graphs["model"]
    with pytest.raises(PlanError, match=r"is a profile of mlp-deep with batch size 512 \(sgd\), not of mlp with batch size 512 \(sgd\): its model differs"):
        _use("profile", path, saved, tg=tg, model="mlp")
    # The file relabelled (or written without labels): the graph fingerprint refuses it,
    # naming both fingerprints.
    from remat.profile.profiles import graph_fingerprint

    tg, _ = other_graphs["batch"]
    doc = _doc(saved, "profile")
    doc.update(batch_size=256)
    relabelled = _write(tmp_path, "profile", doc)
    with pytest.raises(
        PlanError,
        match=rf"{re.escape(str(relabelled))}: this profile \(mlp-deep, batch 256\) was measured on another graph \(fingerprint {fp[:12]}…, "
        rf"this graph {graph_fingerprint(tg)[:12]}…\)",
    ):
        _use("profile", relabelled, saved, tg=tg, batch_size=256)


def test_plan_command_refuses_a_broken_profile(saved, tmp_path):
    # End to end: `remat plan --profile` with a damaged profile stops before planning.
    from remat.cli.plan import plan_command

    text = saved["profile"].read_text()
    bad = tmp_path / "profile.json"
    bad.write_text(text[: len(text) // 3])
    out = tmp_path / "out"
    with pytest.raises(PlanError, match="is truncated"):
        plan_command(MODEL, BATCH, "0.85", profile_path=bad, out_dir=out, runs=1, progress=False)
    assert not (out / "plan.json").exists()


def test_saving_is_atomic(saved, tmp_path):
    # A save that fails half-way through the JSON leaves the previous file whole, and no
    # temporary file behind.
    path = tmp_path / "plan.json"
    shutil.copy(saved["plan"], path)
    before = path.read_text()
    plan = Plan.from_json(path)
    plan.meta["late"] = object()  # not JSON: the writer fails after most of the text
    with pytest.raises(TypeError, match="not JSON serializable"):
        plan.to_json(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_huge_file_is_refused_unread(saved, tmp_path, monkeypatch):
    import remat.serialize

    monkeypatch.setattr(remat.serialize, "MAX_DOCUMENT_BYTES", 1000)
    for kind in KINDS:
        with pytest.raises(PlanError, match=rf"is \d+ bytes, too large for a {FORMAT[kind]} file \(at most 1000\); refused unread"):
            _load(kind, saved[kind])
