"""The runnable graph replayed as a CUDA graph: one launch for the whole step.

A step of a few thousand small kernels keeps the host behind the GPU (each op is a Python
call that launches a kernel). Captured once into a `torch.cuda.CUDAGraph`, the step is
replayed with one call: the same kernels on the same addresses, so the same bits.

What a replay cannot see is kept out of it or checked at every call:
- The batch is copied into buffers the graph owns (the user's tensors are never written).
- Parameters, buffers, gradients held over and optimizer state are used where they live
  (the graph updates them in place); a number the graph reads on the host (hyperparameters
  and numbers of the loop, turned into kernel arguments at capture) is part of the key, as
  is each persistent tensor's address and every shape. A call whose key differs from the
  captured one captures again (a learning-rate schedule that changes every step captures
  at every step: correct, but no faster; the report's `cuda_graph_captures` counts them).
- The outputs (the loss, and each gradient left on a parameter) live in the graph's memory
  and are overwritten by the next replay. Before it replays, a tensor handed out by the
  last replay that is still held is moved to memory of its own (`t.data = t.clone()`); a
  view of one that is still held is an error, since it cannot be moved.
- Random ops draw from the device's generator, which the capture makes graph-safe (each
  replay draws what eager's step would); replaying a random op's state for a recomputed
  copy sets the generator on the host, which a graph cannot capture, so with CUDA graphs
  the planner keeps random ops' outputs (`GraphIndex.forbid_replay`, called by the runtime).

The first `WARMUP_CALLS` calls run the graph as it is (its peak is measured there, as
without CUDA graphs; libraries initialise on first use); the capture happens at the next
call, on a stream of its own, and what it reserves is the graph's memory from then on
(`pool_bytes`, measured with the allocator's cache emptied, as the capture empties it).
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.capture.train_graph import GraphInput, InputKind, TrainGraph
from remat.errors import RematError
from remat.ops.known_values import SIZE_CHECK_OP
from remat.ops.value_checks import VALUE_CHECK_OP

WARMUP_CALLS = 1
MAX_HOST_ELEMENTS = 64  # a host tensor the graph reads is keyed by its values: small ones only


def check_replayable(tg: TrainGraph) -> None:
    """Refuse a step a CUDA graph cannot replay."""
    if tg.runs_another_graph_later():
        raise RematError(
            "cuda_graph=True replays the step on fixed buffers, but this step adds its gradients to those it finds "
            "set (gradient accumulation across calls), which the loop replaces; loop over the micro-batches inside "
            "train_step, or use cuda_graph=False"
        )
    checks = _host_checks(tg)
    if checks:
        raise RematError(
            f"cuda_graph=True replays the step without the host, but this step reads values on the host at every call "
            f"to check them ({len(checks)}: {'; '.join(checks[:3])}{'; ...' if len(checks) > 3 else ''}), which a CUDA "
            "graph cannot do. Use cuda_graph=False, or remove what is checked (a raise or assert on a tensor's value, "
            "a size taken from the batch's values)"
        )
    if torch.device(tg.device).type != "cuda":
        raise RematError(f"cuda_graph=True replays the step on a GPU; this step runs on {tg.device}. Use cuda_graph=False")


def _host_checks(tg: TrainGraph) -> list[str]:
    """Where the graph's value and size checks come from (each reads a value on the host), once per line."""
    found = []
    for node in tg.gm.graph.nodes:
        if node.target is VALUE_CHECK_OP:
            check = tg.call.value_checks[node.args[2]]
            found.append(f"a branch on a value{check.where}")
        elif node.target is SIZE_CHECK_OP:
            found.append(f"a size from the batch's values{node.args[2]}")
    return list(dict.fromkeys(found))  # one per line of the user's code


class CudaBackend:
    """What the step needs of CUDA: a stream, a graph, the allocator's reserved bytes.
    Tests put a stand-in here to run the same logic on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # a capture needs a stream other than the default

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        """`fn`'s outputs as captured (not yet computed) and the replay."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: a loader's pin-memory thread may call CUDA while the step is captured.
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        return out, graph.replay

    def reserved_bytes(self) -> int:
        """The allocator's reserved bytes, its cache of freed blocks given back first (as a capture does)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors share `t`'s storage (None where torch does not say)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return None if counter is None else int(counter(t.untyped_storage()._cdata))


class CudaGraphStep:
    """Calls like the runnable graph `gm(*inputs) -> (outputs, grads)`, replaying it as a CUDA graph."""

    def __init__(self, gm: Callable[..., Any], inputs: Sequence[GraphInput], backend: Any) -> None:
        self.gm = gm
        # Read on the host and turned into kernel arguments: keyed by value. A float of the
        # batch is one too (its input is a 0-dim CPU tensor).
        self.host_read = {
            i for i, gi in enumerate(inputs)
            if gi.kind in (InputKind.HYPERPARAMETER, InputKind.NUMBER) or (gi.kind is InputKind.BATCH and gi.device == "cpu" and gi.shape == ())
        }
        self.batch = [i for i, gi in enumerate(inputs) if gi.kind is InputKind.BATCH and i not in self.host_read]
        self.names = [gi.name for gi in inputs]
        self._warned: set[str] = set()
        self.backend = backend
        self.calls = 0
        self.captures = 0
        self.pool_bytes: int | None = None  # what the last capture reserved for the graph's memory
        self._key: tuple[Any, ...] | None = None
        self._static: list[Any] = []
        self._out: Any = None
        self._replay: Callable[[], None] | None = None
        # Each tensor handed out by the last replay: (it, weakly; the graph's own; its storage; that storage's use count then).
        self._handed: list[tuple[weakref.ref[torch.Tensor], torch.Tensor, int, int | None]] = []

    def __call__(self, *inputs: Any) -> Any:
        self.calls += 1
        if self.calls <= WARMUP_CALLS:
            return self.gm(*inputs)
        self._release()
        key = self._key_of(inputs)
        if key != self._key:
            self._warn_changed(key)
            self._capture(inputs, key)
        else:
            for i in self.batch:
                self._static[i].copy_(inputs[i])
        assert self._replay is not None
        self._replay()
        return self._hand_out()

    def _warn_changed(self, key: tuple[Any, ...]) -> None:
        """Say once per input what made the graph be captured again."""
        if self._key is None:
            return
        changed = [self.names[i] for i, (a, b) in enumerate(zip(key, self._key)) if a != b and self.names[i] not in self._warned]
        if changed:
            self._warned.update(changed)
            warnings.warn(
                f"remat: cuda_graph=True: the step is captured again, because {', '.join(changed[:5])} changed since the "
                "last capture (a number read on the host is fixed in a CUDA graph, as is each tensor's address). One that "
                "changes at every step makes every step a capture: the step count Adam and AdamW keep on the host by default "
                "is kept on the GPU when the optimizer is created with fused=True",
                stacklevel=4,
            )

    def _key_of(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        key: list[Any] = []
        batch = set(self.batch)
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                key.append(t)
                continue
            layout = (t.shape, t.stride(), t.dtype, t.device)
            if i in self.host_read or (t.device.type != self.backend.device.type and i not in batch):
                if t.numel() > MAX_HOST_ELEMENTS:
                    raise RematError(
                        f"cuda_graph=True: the step reads a host tensor of {t.numel()} elements at every call ({self.names[i]}); "
                        "a CUDA graph fixes what the host reads at capture. Move it to the GPU, or compile with cuda_graph=False"
                    )
                key.append((layout, tuple(t.reshape(-1).tolist())))
            elif i in batch:
                key.append(layout)
            else:
                key.append((layout, t.data_ptr()))
        return tuple(key)

    def _capture(self, inputs: Sequence[Any], key: tuple[Any, ...]) -> None:
        self._replay, self._out, self._static = None, None, []  # the last graph's memory goes back first
        static = list(inputs)
        for i in self.batch:
            t = inputs[i]
            static[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            static[i].copy_(t)
        before = self.backend.reserved_bytes()
        try:
            out, replay = self.backend.capture(lambda: self.gm(*static))
        except Exception as e:
            raise RematError(
                f"cuda_graph=True: the step could not be captured as a CUDA graph ({type(e).__name__}: {e}). A step that "
                "synchronises with the host (`.item()` on a GPU tensor, a data-dependent branch, a check on a tensor's value such as an assert on the loss) or talks to other processes "
                "cannot be captured; compile with cuda_graph=False"
            ) from e
        self.pool_bytes = self.backend.reserved_bytes() - before
        self._static, self._out, self._replay, self._key = static, out, replay, key
        self.captures += 1

    def _hand_out(self) -> Any:
        """The outputs as new tensors on the graph's memory (the graph keeps its own to write into)."""
        handed = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, self._out)
        pairs = zip(pytree.tree_leaves(handed), pytree.tree_leaves(self._out))
        self._handed = [
            (weakref.ref(t), original, original.untyped_storage().data_ptr(), _use_count(original))
            for t, original in pairs
            if isinstance(t, torch.Tensor)
        ]
        return handed

    def _release(self) -> None:
        """Move what the user still holds of the last replay's outputs out of the graph's memory."""
        dead = collections.Counter(storage for ref, _, storage, _ in self._handed if ref() is None)  # aliases let go
        for _, original, storage, count in self._handed:
            now = _use_count(original)
            if count is not None and now is not None and now > count - dead[storage]:
                raise RematError(
                    "cuda_graph=True: a view of a tensor the last step returned (an output, or a parameter's .grad) is "
                    "still held, and the next replay writes into its memory. Keep a copy (`.clone()`) instead of the view, "
                    "or compile with cuda_graph=False"
                )
        for ref, _, _, _ in self._handed:
            t = ref()
            if t is not None:
                with torch.no_grad():
                    t.data = t.clone()
        self._handed = []
