"""Fresh pages an eager training step writes: the minor page faults of each step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_faults.py --model bert --batch-size 8 --steps 4

On a CPU, glibc returns the top of its heap to the system once enough of it is free (its
trim threshold, at most 64 MiB) and maps blocks above its mmap threshold (at most 32 MiB)
afresh at every allocation, so the memory a step builds up is, in good part, paged in again
at every step; each page's first write is a fault. Prints each step's seconds and faults
(as MiB of 4 KiB pages).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from remat.models import build_model, make_optimizer, make_train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    spec = build_model(args.model, args.batch_size)
    optimizer = make_optimizer("sgd", spec.model.parameters())
    step = make_train_step(spec.loss_fn)
    page = resource.getpagesize()
    for i in range(args.steps):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step(spec.model, optimizer, spec.batch)
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"step {i}: {seconds:.2f} s, {faults} minor faults ({faults * page / 2**20:,.0f} MiB of pages)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
