"""Graph rewriter: emit the captured graph in a schedule's order, with its recompute copies
(and its lean operator variants' out= calls, kept beside the module: `TrainGraph.lean_into`).

Each copy step becomes a new node (the original op, or its state-free twin) that reads the
copies of its rebuilt inputs and the originals of its sources; every node after the
forward pass that read a dropped value reads the copy instead. Forward ops the schedule
removed are not emitted, so the forward original of a dropped activation dies after its
last forward use, and fx's generated code frees every value after its last use in the new
order: the order the simulator assumed.

A copied random op replays the draw of its original: the generator's state is saved just
before the original runs, and the copy runs with the generator set to it and set back
after (`rng_replay.Replay`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from remat.gc_pause import gc_paused
from remat.memory.analysis import refresh_fake_values
from remat.passes.lean_ops import out_call
from remat.capture.train_graph import Phase, TrainGraph
from remat.ops.op_facts import copy_call
from remat.ops.rng_replay import RNG_SAVE, Replay, op_device
from remat.memory.schedule import ORIGINAL, GraphIndex, Schedule

RECOMPUTED_SUFFIX = "_recomputed"


@dataclass
class Rewritten:
    gm: torch.fx.GraphModule
    phase: dict[str, Phase]  # every call_function node of `gm`; copies take their reader's phase
    copies: dict[str, str]  # copy node name -> the original node it rebuilds


@gc_paused()
def rewrite(index: GraphIndex, schedule: Schedule) -> Rewritten:
    tg: TrainGraph = index.tg
    old = tg.gm.graph
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}  # original name -> emitted original
    rebuilt: dict[tuple[str, int], torch.fx.Node] = {}  # (original name, instance) -> emitted copy
    for node in old.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])

    copies: dict[str, str] = {}
    replayed = {s.node for s in schedule.steps if s.copy and s.node in index.random}
    saved_state: dict[str, torch.fx.Node] = {}
    for step, reads in zip(schedule.steps, schedule.reads):
        node = index.node_map[step.node]
        device = op_device(node, tg.device)
        if step.node in replayed and not step.copy:
            saved_state[step.node] = graph.call_function(RNG_SAVE, (device,), name=node.name + "_rng_state")
        source = {a: (env[a] if instance == ORIGINAL else rebuilt[(a, instance)]) for a, instance in reads}

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            return source[n.name] if n.name in source else env[n.name]

        if step.copy:
            target, args, kwargs = copy_call(node)
            args = torch.fx.map_arg(args, arg)
            if step.node in replayed:
                target, args = Replay(target), (saved_state[step.node], device, *args)
            new = graph.create_node("call_function", target, args, torch.fx.map_arg(kwargs, arg), name=node.name + RECOMPUTED_SUFFIX)
            new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
            rebuilt[(node.name, step.instance)] = new
            copies[new.name] = node.name
        else:
            env[node.name] = new = graph.node_copy(node, arg)
            if step.node in tg.lean_into:
                new.target, new.kwargs = out_call(new, env[tg.lean_into[step.node]])
                del new.meta["val"]  # its result is now on its input's storage

    output = next(n for n in old.nodes if n.op == "output")
    out_source = {a: env[a] for a, _ in schedule.output_reads}
    graph.output(torch.fx.map_arg(output.args[0], lambda n: out_source[n.name]))
    graph.lint()
    gm = torch.fx.GraphModule(tg.gm, graph)

    refresh_fake_values(gm)  # each copy gets a storage of its own for the analysis, a lean variant its input's

    phase: dict[str, Phase] = {}
    following = Phase.OPTIMIZER
    for node in reversed([n for n in gm.graph.nodes if n.op == "call_function"]):
        if node.name in copies or node.name not in tg.phase:
            phase[node.name] = following
        else:
            phase[node.name] = tg.phase[node.name]
            following = phase[node.name]
    return Rewritten(gm=gm, phase=phase, copies=copies)


def runnable(index: GraphIndex, schedule: Schedule) -> torch.fx.GraphModule:
    """The module that runs `schedule`: the graph's own where the schedule is the graph as it
    stands (nothing copied, and nothing kept beside its module: an order, lean variants),
    else the rewrite."""
    if not schedule.copies and index.tg.order is None and not index.tg.lean_into:
        return index.tg.gm
    return rewrite(index, schedule).gm
