"""Refuse a step that sets the global random-number generator's state while it runs, or
draws from Python's or numpy's generators.

Random ops are recorded in the graph and draw from the generator when the graph runs;
`torch.manual_seed`, `torch.set_rng_state` or `torch.random.fork_rng` inside the step run
once, while it is traced, and are not in the graph. The graph's dropout masks, and the
generator's state after each step, would then differ from eager's, with no error. A draw
from `random` or `numpy.random` (a mixup coefficient, a coin flip for an augmentation)
also runs once: every step would reuse the first draw.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Iterator

import torch

from remat.errors import CaptureError

_SETTERS = ("manual_seed", "set_rng_state", "seed")


def _refusal(what: str) -> CaptureError:
    return CaptureError(
        f"train_step {what} while it runs, which one captured graph cannot repeat: the graph's random ops draw from "
        "the generator as it is when each step runs. Seed or fork the generator outside train_step (before the "
        "loop, or between steps), not inside it."
    )


@contextlib.contextmanager
def no_rng_state_set() -> Iterator[None]:
    """Around the user's step while it is traced: refuse a call that sets the CPU or a
    CUDA generator's state, and any other change to the CPU generator's state."""
    before = torch.get_rng_state()
    saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def refusing(name: str) -> Callable[..., Any]:
        also = " (torch.random.fork_rng does when it ends)" if name.startswith("set_rng_state") else ""

        def call(*args: Any, **kwargs: Any) -> Any:
            raise _refusal(f"calls torch.{name}(){also}")

        return call

    modules = [torch, torch.random] + ([torch.cuda] if torch.cuda.is_available() else [])
    for module in modules:
        for name in _SETTERS + (("manual_seed_all", "set_rng_state_all") if module is torch.cuda else ()):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refusing(name))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    if not torch.equal(before, torch.get_rng_state()):
        torch.set_rng_state(before)
        raise _refusal("changes the random-number generator's state")


def _host_generators(values: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Python's and numpy's global generators, and those objects among `values` (name, value)."""
    found: list[tuple[str, Any]] = [("Python's random module (random.random(), random.choice(), ...)", random._inst)]  # type: ignore[attr-defined]
    numpy = sys.modules.get("numpy")
    kinds: tuple[type, ...] = (random.Random,)
    if numpy is not None:
        found.append(("numpy's global generator (np.random.rand(), np.random.beta(), ...)", numpy.random.mtrand._rand))
        kinds += (numpy.random.Generator, numpy.random.RandomState)
    found += [(name, v) for name, v in values if isinstance(v, kinds) and all(v is not g for _, g in found)]
    return found


def _state(generator: Any) -> Any:
    return generator.getstate() if isinstance(generator, random.Random) else (
        generator.bit_generator.state if hasattr(generator, "bit_generator") else generator.get_state(legacy=False)
    )


def _restore(generator: Any, state: Any) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


@contextlib.contextmanager
def no_host_random_drawn(values: list[tuple[str, Any]]) -> Iterator[None]:
    """Around the user's step while it is traced: refuse a draw from Python's or numpy's
    generators (the global ones, and those among the user's state `values`: (name, value)),
    putting their states back."""
    generators = _host_generators(values)
    before = [_state(g) for _, g in generators]
    failed: BaseException | None = None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - a draw, if any, is said first: the trace may have failed on what it drew
        failed = e
    drawn = [name for (name, g), state in zip(generators, before) if not _same(_state(g), state)]
    for (_, g), state in zip(generators, before):  # a trace that fails (one side of a value check tried) puts them back too
        _restore(g, state)
    if failed is not None and not drawn:
        raise failed
    if drawn:
        raise CaptureError(
            f"train_step draws from {drawn[0]} while it runs: its Python code runs once, at capture, so every step "
            "would reuse that first draw. Draw with torch's generator instead (torch.rand, torch.randint, "
            "torch.distributions: the graph draws those at every step, as eager does), or draw outside train_step "
            "and pass the values in the batch. Where a library draws it: Hugging Face's speech models (wav2vec2, "
            "HuBERT, WavLM, ...) mask time steps and features with numpy in training (SpecAugment): set "
            "apply_spec_augment=False, or mask_time_prob=0 and mask_feature_prob=0, in the model's config."
        ) from failed


def _same(a: Any, b: Any) -> bool:
    """States compared: tuples, dicts and numpy arrays in them."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "tolist"):
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)
