"""One region's graph compiled by Inductor, at its first call: its outputs in the layouts
eager's kernels give them, one function per layout its inputs arrive in, and op by op, as
planned, where Inductor cannot compile it. `passes.inductor_regions` cuts the regions."""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx


@dataclass
class Region:
    name: str  # also the name of its call's node
    kind: str  # a Phase's value, or inductor_regions.RECOMPUTE
    ops: list[str]  # the graph's node names it runs, in order
    compile_seconds: float = 0.0
    error: str = ""  # why Inductor could not compile it, where it could not: it then runs op by op


def inductor(sub: torch.fx.GraphModule, example: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], Any]:
    """The region's graph compiled by Inductor for inputs laid out as `example`: a function of
    the boxed inputs (a list it empties, freeing each input after its last use)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    sub = copy.deepcopy(sub)  # the region's own graph stays as planned: a layout compiled later, or run eagerly
    keep_eager_layouts(sub, example)
    decomposed = make_fx(sub, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example)
    # Every output is one the user sees: Inductor keeps the strides it was traced with (those
    # forced above) and picks its own layouts (channels-last convolutions) only inside.
    output = next(n for n in decomposed.graph.nodes if n.op == "output")
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))
    # No padded strides (Inductor pads a CUDA tensor's rows to an aligned length): an output
    # must have eager's strides, which the next region and the plan's byte counts assume.
    with torch._inductor.config.patch(comprehensive_padding=False, pad_outputs=False):
        return compile_fx_inner(decomposed, example)


def keep_eager_layouts(sub: torch.fx.GraphModule, example: list[torch.Tensor]) -> None:
    """Make each output of the region in the layout eager's kernels give it: a trace's strides
    can differ from a CPU kernel's, and the ops after the region were planned with eager's
    (a mismatched layout makes the next kernel copy its input: bytes the plan does not hold).
    Read from one eager run of the region's own graph."""
    from torch._inductor import inductor_prims
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    with torch.no_grad():
        strides = [o.stride() if isinstance(o, torch.Tensor) and dense(o) else None for o in sub(*example)]
    output = next(n for n in sub.graph.nodes if n.op == "output")
    values = list(output.args[0])
    with sub.graph.inserting_before(output):
        for i, (value, stride) in enumerate(zip(values, strides)):
            if stride is not None:  # Inductor picks the layout of an output it is not told (channels-last here and there)
                values[i] = sub.graph.call_function(inductor_prims.force_stride_order, (value, list(stride)))
    output.args = (tuple(values),)
    sub.recompile()


class CompiledRegion:
    """A region's function, compiled at its first call with that call's inputs as the examples:
    their real strides (a CPU kernel's output may be laid out otherwise than its trace says),
    which Inductor's code then checks at every call. Inputs laid out otherwise later (a region
    before it compiled in a later cut) get a function of their own."""

    def __init__(self, sub: torch.fx.GraphModule, compiler: Callable[..., Any], region: Region):
        self.sub, self.compiler, self.region = sub, compiler, region
        self.fns: dict[tuple[Any, ...], Callable[[list[torch.Tensor]], Any]] = {}

    def __call__(self, args: list[torch.Tensor]) -> Any:
        layout = tuple((a.shape, a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else None for a in args)
        fn = self.fns.get(layout)
        if fn is None:
            start = time.perf_counter()
            try:
                fn = self.compiler(self.sub, args)
            except Exception as e:  # noqa: BLE001 - Inductor failing on one region's graph costs its speed, not the step
                self.region.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                warnings.warn(
                    f"remat: Inductor could not compile {self.region.name} ({len(self.region.ops)} ops, from "
                    f"{self.region.ops[0]} to {self.region.ops[-1]}): {self.region.error}. It runs op by op, as planned; "
                    "the rest of the step keeps its compiled regions",
                    stacklevel=2,
                )
                fn = torch.fx.Interpreter(self.sub).boxed_run
            self.fns[layout] = fn
            self.region.compile_seconds += time.perf_counter() - start
        return fn(args)
