"""Measure the peak memory a callable allocates, from the allocator itself.

On CUDA: the caching allocator's peak (`max_memory_allocated` after a reset). On CPU: the
CPU allocator's own allocation and free events, recorded by `torch.profiler` with
`profile_memory=True`; the highest level they reach is the peak. That sees scratch buffers
kernels allocate inside themselves, which a tracker of op outputs misses. Process RSS is
no measure (the C allocator keeps freed pages).

The profiler records only the events of the thread it runs on, but a tensor is not always
freed there: gloo's worker threads drop a finished collective's buffers (inputs, outputs,
temporaries), often after the caller has moved on. A running sum of the caller's events
never sees those frees and climbs with every collective (hundreds of MiB over one FSDP2
step). So while measuring, the CPU allocator's process-wide count is switched on (c10's
`caffe2_report_cpu_memory_usage` flag: every thread's allocations and frees counted
under one lock) and each recorded event carries that count: the level at the event, all
threads included. It is read at the caller's events, so a worker's allocation between two
of them counts from the next one on. Where the flag cannot be reached (a libc10 that does
not export it) the caller's running sum stands in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from remat.gc_pause import gc_paused


@dataclass
class Measured:
    result: Any
    peak_bytes: int  # most bytes allocated at once during the call, above what was live before
    end_bytes: int  # bytes still allocated (by the call) when it returned
    # CUDA only: the most bytes of segments the caching allocator held during the call,
    # above the bytes allocated at its start (after emptying its cache). The segments that
    # hold what was live at the start have room left over, which the call's tensors fill
    # first: counted above the reserved bytes at the start, that room would go unseen and
    # this could read below the allocated peak. An out-of-memory happens when reserving
    # fails, so this, not the allocated peak, is what must fit the card; the gap between
    # the two is the allocator's rounding and fragmentation. None on CPU.
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


def _process_wide_flag() -> ctypes.c_bool | None:
    """c10's switch for counting every thread's CPU allocations, or None where not exported."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[profile]:
    """A started `torch.profiler` recording the CPU allocator's events with the process-wide
    count on, quiet, the garbage collector paused (a collection inside would free tensors at
    a moment of its own), the level read as it starts and as it stops; stopped on exit."""
    flag = _process_wide_flag()
    was = flag.value if flag is not None else False
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with gc_paused():
        before = [] if _unknown_free_noted else [torch.empty(1)]
        if flag is not None:
            flag.value = True
        with quiet_stdio():
            prof.start()
            _note_unknown_free(before)
        try:
            _read_level()
            yield prof
        finally:
            _read_level()
            with quiet_stdio():
                prof.stop()
            if flag is not None:
                flag.value = was


_unknown_free_noted = False


def _note_unknown_free(before: list[torch.Tensor]) -> None:
    """Free the tensor in `before`, allocated before the profile started, to spend c10's note on such a
    free ("Memory block of unknown size was allocated before the profiling started"; it
    logs one in a thousand) while stderr is quiet. The frees it notes are expected: a
    tensor made before the measured call (the last step's gradients, a collective's buffer
    on gloo's thread) was never counted, so its free is rightly left out of the level."""
    global _unknown_free_noted
    if before:
        before.clear()
        _unknown_free_noted = True


_LEVEL_MARK = "remat: allocator level"


def _read_level() -> None:
    """An allocation and its free on this thread, marked: the free's event carries the bytes
    live at this moment (other threads' frees since the caller's last event included)."""
    with record_function(_LEVEL_MARK):
        torch.empty(1)


def cpu_memory_events(prof: profile) -> list[tuple[int, int, int]]:
    """(time ns, bytes: + allocation / - free, bytes live) of the CPU allocator, in time order.

    Bytes live are relative to just before the first event: the process's, every thread's,
    where the profile was taken with `cpu_memory_profile`; else those of the threads the
    profiler records (the running sum of the events)."""
    events: list[tuple[int, int, int]] = []
    allocation = torch._C._profiler._EventType.Allocation

    def visit(nodes: Any, marked: bool) -> None:  # recursion as deep as ops nest
        for e in nodes:
            if e.tag == allocation:
                fields = e.extra_fields
                if fields.device.type != "cpu":
                    continue
                if not marked:
                    events.append((e.start_time_ns, fields.alloc_size, fields.total_allocated))
                elif fields.alloc_size < 0:  # a reading of the level (`_read_level`): no change of its own
                    events.append((e.start_time_ns, 0, fields.total_allocated))
            else:
                children = e.children
                if children:
                    visit(children, marked or e.name == _LEVEL_MARK)

    visit(prof.profiler.kineto_results.experimental_event_tree(), False)
    events.sort(key=lambda x: x[0])
    if not events:
        return []
    base = events[0][2] - events[0][1]
    return [(t, nbytes, total - base) for t, nbytes, total in events]


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
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return Measured(
            result,
            torch.cuda.max_memory_allocated(device) - start,
            torch.cuda.memory_allocated(device) - start,
            torch.cuda.max_memory_reserved(device) - start,
        )
    if device.type != "cpu":
        raise ValueError(f"cannot measure memory on device {device}: only cpu and cuda are supported")
    with cpu_memory_profile() as prof:
        result = fn()
    levels = [live for _, _, live in cpu_memory_events(prof)]
    return Measured(result, max([0, *levels]), levels[-1] if levels else 0)


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
