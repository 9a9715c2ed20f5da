"""Run a function on N local processes, each one rank of a process group on 127.0.0.1.

What `remat run --nproc N` and the data-parallel tests use instead of `torchrun`: each
rank is a fresh process, forked from a server process that imported torch and `fn`'s
module once (multiprocessing's forkserver: no state of the caller is inherited, and a
rank starts in a fraction of a second instead of importing torch again), joined to a gloo process group (CPU) with a timeout,
so that a rank stuck in a collective fails instead of hanging. Every rank's return value comes back to the caller;
a rank that raised, or ranks still running at the deadline (then killed), make
`RanksFailed` with each rank's error.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from remat.errors import RematError


class RanksFailed(RematError):
    """A rank raised, or did not finish in time; `errors` maps each such rank to its error text."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, pg_timeout_s: float, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as e:  # noqa: BLE001 - every rank's failure goes back to the caller
        text = "".join(traceback.format_exception(e))
        results.put((rank, "error", text))


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """`fn(*args)` on ranks 0..nprocs-1 (fn must be importable: a module-level function);
    returns each rank's result, in rank order. `pg_timeout_s` is the process group's
    timeout (a collective waiting longer fails); `timeout_s` bounds the whole run."""
    if nprocs < 1:
        raise RematError(f"--nproc must be at least 1, got {nprocs}")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (at the first call). A script's own module is imported by
    # each rank, as under spawn, never by the server.
    ctx.set_forkserver_preload(["torch"] + ([fn.__module__] if fn.__module__ != "__main__" else []))
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, nprocs, port, pg_timeout_s, fn, args, results), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcome) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                outcome[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome and p.exitcode not in (0, None)]
                for r in dead:
                    outcome[r] = ("error", f"rank {r} exited with code {procs[r].exitcode} without a result")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (status, v) in outcome.items() if status == "error"}
    errors.update({r: f"rank {r} did not finish within {timeout_s:.0f} s" for r in range(nprocs) if r not in outcome})
    if errors:
        first = min(errors)
        raise RanksFailed(f"{len(errors)} of {nprocs} ranks failed; rank {first}:\n{errors[first]}", errors)
    return [outcome[r][1] for r in range(nprocs)]
