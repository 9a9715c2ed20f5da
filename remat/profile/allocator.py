"""Measure the peak memory a callable allocates, from the allocator itself.

On CUDA: the caching allocator's peak (`max_memory_allocated` after a reset). On CPU: the
CPU allocator's own allocation and free events, recorded by `torch.profiler` with
`profile_memory=True`; the running sum's maximum is the peak. That sees scratch buffers
kernels allocate inside themselves, which a tracker of op outputs misses. Process RSS is
no measure (the C allocator keeps freed pages).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from remat.gc_pause import gc_paused


@dataclass
class Measured:
    result: Any
    peak_bytes: int  # most bytes allocated at once during the call, above what was live before
    end_bytes: int  # bytes still allocated (by the call) when it returned
    # CUDA only: the most bytes of segments the caching allocator reserved during the call
    # beyond those it held at the start (after emptying its cache). An out-of-memory
    # happens when reserving fails, so this, not the allocated peak, is what must fit the
    # card; the gap between the two is the allocator's rounding and fragmentation. None on CPU.
    reserved_peak_bytes: int | None = None


@contextlib.contextmanager
def quiet_stdio() -> Iterator[None]:
    """Kineto prints start/stop lines on the process's own stdout/stderr; keep them out."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        for fd, s in zip((1, 2), saved):
            os.dup2(s, fd)
            os.close(s)
        os.close(devnull)


def cpu_memory_events(prof: profile) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocation / - free) of the CPU allocator, in time order."""
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda x: x[0])
    return events


def measure_step_peak(fn: Callable[[], Any], device: str | torch.device, model: torch.nn.Module) -> Measured:
    """`measure_peak` of a training step of `model` that starts by dropping the previous
    gradients: they are dropped first. Freed inside the run, they would be subtracted from
    what the run allocates (both allocators report the free), and the peak would read low
    by up to their size: not what the step itself allocates (seen in `remat bench` with a
    step that calls zero_grad() first)."""
    for p in model.parameters():
        p.grad = None
    return measure_peak(fn, device)


def measure_peak(fn: Callable[[], Any], device: str | torch.device = "cpu") -> Measured:
    """Run `fn()` once and measure the most bytes it held at once on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # segments cached by earlier runs would hide this run's need
        start = torch.cuda.memory_allocated(device)
        start_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return Measured(
            result,
            torch.cuda.max_memory_allocated(device) - start,
            torch.cuda.memory_allocated(device) - start,
            torch.cuda.max_memory_reserved(device) - start_reserved,
        )
    if device.type != "cpu":
        raise ValueError(f"cannot measure memory on device {device}: only cpu and cuda are supported")
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with gc_paused():
        with quiet_stdio():
            prof.start()
        try:
            result = fn()
        finally:
            with quiet_stdio():
                prof.stop()
    running = peak = 0
    for _, nbytes in cpu_memory_events(prof):
        running += nbytes
        peak = max(peak, running)
    return Measured(result, peak, running)


def persistent_bytes(model: Any, optimizer: Any, batch: Any = None) -> int:
    """Bytes of the storages alive before and after a step: parameters, buffers, optimizer
    state, and the batch the step is given (held by the caller throughout), as the
    analysis counts them (`analysis.persistent_by_role`). A run measured from its start
    sees none of these: its peak is this plus what the run allocates."""
    import torch
    import torch.utils._pytree as pytree

    from remat.capture.optimizers import as_one

    seen: dict[Any, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
    for b in model.buffers():
        add(b)
    optimizer = as_one(optimizer)  # one, or a list of them
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    for leaf in pytree.tree_leaves(batch):
        add(leaf)
    return sum(seen.values())
