"""Exact replay of random ops: the generator state an op consumed, saved before it runs
and set again around its rebuilt copy, so that the copy draws exactly the numbers the
original drew and the global random stream is left where it was.

Two ops do it, so that they are ordinary nodes of the rewritten graph (with fake
implementations, for the analysis of that graph):
- `rng_save(device)`: the default generator's state for `device` (a CPU byte tensor;
  on CPU the Mersenne Twister state, on CUDA the Philox seed and offset);
- `Replay(op)(state, device, *args)`: runs `op` with that generator set to `state`, and
  sets it back after.

`generators_kept(gm, device)` is the context the graph runs in when it runs for remat's own
sake (profiling, timing): the default generators and every generator of the user's the
graph draws from (`torch.randn(..., generator=g)`) are left as they were.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx
from torch._subclasses.fake_tensor import is_fake

_STATE_BYTES: dict[str, int] = {}


def _generator(device: str) -> torch.Generator:
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        torch.cuda.init()
        return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    raise NotImplementedError(f"remat cannot replay random ops on {dev.type} devices")


def state_bytes(device: str) -> int:
    """Bytes of one saved generator state for `device`'s generator (it lives on the host)."""
    kind = torch.device(device).type
    if kind not in _STATE_BYTES:
        _STATE_BYTES[kind] = int(_generator(device).get_state().numel())
    return _STATE_BYTES[kind]


def held_bytes(device: str) -> int:
    """Device bytes of one generator state held for replay: a state saved for a copy, or the
    one a copy sets aside while it runs (`Replay`). The state is a host tensor, so it counts
    only where the host is the device measured (CPU)."""
    return state_bytes(device) if torch.device(device).type == "cpu" else 0


def graph_generators(gm: torch.fx.GraphModule) -> list[torch.Generator]:
    """The generators of the user's that `gm`'s random ops draw from: attributes of it or of
    its submodules (compiled regions)."""
    found = {id(v): v for module in gm.modules() for v in vars(module).values() if isinstance(v, torch.Generator)}
    return list(found.values())


@contextlib.contextmanager
def generators_kept(gm: torch.fx.GraphModule, device: torch.device) -> Iterator[None]:
    """Run `gm` for remat's own sake: the default generators (CPU, and `device`'s on CUDA)
    and the user's generators it draws from are put back as they were when it ends, so the
    user's first step draws what eager's would."""
    own = graph_generators(gm)
    states = [g.get_state() for g in own]
    try:
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            yield
    finally:
        for g, state in zip(own, states):
            g.set_state(state)


@torch.library.custom_op("remat::rng_save", mutates_args=())
def rng_save(device: str) -> torch.Tensor:
    """The state of `device`'s default generator, before a random op draws from it."""
    return _generator(device).get_state()


@rng_save.register_fake
def _rng_save_fake(device: str) -> torch.Tensor:
    return torch.empty(state_bytes(device), dtype=torch.uint8, device="cpu")


class Replay:
    """Call target `op` with `device`'s default generator set to `state`, then set it back:
    the copy draws exactly what the original drew and the random stream is left as it was.
    One node of the rewritten graph per copy, so that the graph's steps are the schedule's
    (the state set aside while it runs is held by the node alone: `held_bytes`)."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.__name__ = "replay_" + str(op).replace(".", "_")

    def __call__(self, state: torch.Tensor, device: str, /, *args: Any, **kwargs: Any) -> Any:
        # Positional only: a factory op's own `device=` keyword passes through to it.
        if is_fake(state):  # shape propagation: the op's outputs are all that is asked
            return self.op(*args, **kwargs)
        gen = _generator(device)
        previous = gen.get_state()
        gen.set_state(state)
        try:
            return self.op(*args, **kwargs)
        finally:
            gen.set_state(previous)

    def __repr__(self) -> str:
        return self.__name__


RNG_SAVE = torch.ops.remat.rng_save.default


def op_device(node: torch.fx.Node, default: str) -> str:
    """The device whose generator a random op draws from: that of its tensor output."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return str(val.device) if isinstance(val, torch.Tensor) else default


def replay_problem(node: torch.fx.Node) -> str | None:
    """Why a random op cannot be replayed from the default generator's state (None if it can)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return f"{node.name} is not an aten op"
    schema = target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name != "generator":
            continue
        value = node.kwargs.get("generator", node.args[i] if i < len(node.args) and not arg.kwarg_only else None)
        if value is not None:
            return f"{node.name} draws from a generator of its own"
    device = op_device(node, "cpu")
    if torch.device(device).type not in ("cpu", "cuda"):
        return f"{node.name} runs on {device}, whose generator remat cannot replay"
    return None
