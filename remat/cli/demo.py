"""`remat demo`: the main job on a small default."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remat.cli.profile import run_profile


DEMO_MODELS: tuple[tuple[str, int], ...] = (("bert-tiny", 2), ("resnet-tiny", 2))


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output folder (default: runs/demo)")
    p.add_argument("--profile-only", action="store_true", help="only the two small profiles (seconds), not the BERT bench (minutes)")


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on a small default: profile two small models, then BERT-base's bench
    (eager vs remat vs HF checkpointing at two batch sizes), and say where everything is."""
    from remat.measurement.report import breakdown_table, console_for, phase_table

    console = console_for(sys.stdout)
    written = []
    for model, batch in DEMO_MODELS:
        prof, out, files = run_profile(model, batch, out_dir=Path(args.out) / f"profile-{model}-b{batch}")
        console.print(phase_table(prof))
        console.print(breakdown_table(prof.peak_breakdown, prof.simulated_peak_bytes, title=f"{model}: memory at the peak"))
        scratch = prof.measured_peak_bytes - prof.simulated_peak_bytes
        console.print(
            f"simulated peak {prof.simulated_peak_bytes / 2**20:.2f} MiB, measured {prof.measured_peak_bytes / 2**20:.2f} MiB"
            + (f" (the {scratch / 2**20:.2f} MiB more: kernels' scratch, workspaces held by no tensor, which a plan's "
               "prediction adds node by node)" if scratch > 0 else "") + "\n"
        )
        written.append((model, out, files))
    console.print("[bold]profile outputs[/bold]")
    for model, out, files in written:
        console.print(f"  {model}: {out}/ ({', '.join(p.name for p in files.values())})")
    if not args.profile_only:
        from remat.measurement.sweep import demo

        demo(Path(args.out))
    return 0
