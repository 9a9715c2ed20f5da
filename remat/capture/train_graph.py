"""The captured training iteration (TrainGraph) and what each of its inputs is."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
import torch.fx

from remat.capture.optim import hyperparams
from remat.ops import op_facts

TrainStep = Callable[[torch.nn.Module, "torch.optim.Optimizer | None", Any], torch.Tensor]


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class InputKind(str, Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    # A parameter's `.grad` as the call finds it, which the step's backward adds to in place
    # (gradient accumulation across calls): named by its parameter.
    GRADIENT = "gradient"
    HYPERPARAMETER = "hyperparameter"  # a float of optimizer.param_groups, read at every call
    OUTSIDE = "outside"  # a tensor the user's state holds (a teacher's weight, an EMA copy): outside_tensors
    NUMBER = "number"  # a float or int the loop changes between steps, read from where it is held at every call: read_numbers
    BATCH = "batch"


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the captured graph and where its tensor comes from."""

    name: str  # parameter/buffer name, "<param>.<state key>", or the batch leaf's path
    kind: InputKind
    shape: tuple[int, ...]
    dtype: str
    device: str


@dataclass
class CallContract:
    """What a call of a captured graph needs beside its placeholders: what the loop must
    leave as it was (checked when the inputs are gathered: step_inputs, call_inputs), where
    the inputs read at every call live, and what is done again after each run (the step's
    effects on the user's Python state, its train/eval calls, scheduler steps). One per
    captured graph, shared by the graphs derived from it."""

    batch_spec: str = ""  # pytree structure of the batch, as text, to reject other structures
    batch_read: frozenset[int] = frozenset()  # positions of the batch's plain values (a str, an int) the graph holds: in its key
    batch_sides: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # the batch's ints read at every call it compares: their sides in its key (read_numbers.Condition)
    output_spec: Any = None  # pytree spec of train_step's return value (None: one tensor)
    output_numbers: dict[int, Any] = field(default_factory=dict)  # output position -> 'bool', 'int' or 'float': given back as a Python number; or a scheduler_calls.SchedulerRead: read after the scheduler steps
    # What the step does to the user's Python state, done again after each run on the graph's
    # last outputs: lists it appends numbers to (logged_numbers.LoggedList), numbers it adds
    # to or sets (kept_numbers.KeptNumber), what it prints or logs (step_prints.PrintCall),
    # tensors it leaves in the user's state (kept_tensors.KeptTensor).
    state_updates: list[Any] = field(default_factory=list)
    unread_containers: frozenset[str] = frozenset()  # lists and dicts in the user's state whose contents the step never reads: not in the cache key
    trainable: tuple[str, ...] = ()  # parameters that required a gradient at capture
    param_hooks: dict[str, Any] = field(default_factory=dict)  # parameter name -> param_hooks.ParamHooks traced into the graph
    training: tuple[bool, ...] = ()  # module.training of every module at capture (train/eval behaviour is traced in)
    # train()/eval() calls train_step makes, as (module name, mode), in order; `sets_mode_first`:
    # the first is the whole model's, before any forward, so the mode the step starts in does not matter.
    mode_calls: tuple[tuple[str, bool], ...] = ()
    sets_mode_first: bool = False
    requires_grad_set: tuple[tuple[str, bool], ...] = ()  # requires_grad the step leaves other than it found, as (parameter, flag): set after each run
    outside: dict[str, Any] = field(default_factory=dict)  # OUTSIDE input name -> outside_tensors.OutsideTensor, read at each call
    numbers: dict[str, Any] = field(default_factory=dict)  # NUMBER input name -> the python_state.Slot it is read from at each call
    number_signs: dict[str, int] = field(default_factory=dict)  # NUMBER input name -> its sign, where the step compares it with zero
    number_conditions: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # a number still read at every call -> the read_numbers.Conditions its graph assumes (an int's)
    # The user's code objects the traces ran: python_state watches what they name (None: not
    # recorded, user_code.recording_run; everything the step's code can reach is watched).
    code_read: frozenset[Any] | None = None
    library_read: frozenset[tuple[int, str]] = frozenset()  # (id of the fields dict, field) of the library flags the traces read: library_objects.recording_reads
    set_up: list[Any] = field(default_factory=list)  # first_call.SetUp: what the step's first run sets once, made when the graph first runs
    default_keys: list[Any] = field(default_factory=list)  # python_state.Slot: keys the step makes in a defaultdict, made before each call's key is read (first_call)
    scheduler_calls: tuple[Any, ...] = ()  # scheduler_calls.SchedulerCall: scheduler.step() calls made again at each call
    leaves_zero_grads: bool = False  # the step ends with zero_grad(set_to_none=False): see ends_with_zero_grads
    # The step adds its gradients to those a call finds set (gradient accumulation across
    # calls; or it may: step_inputs.finds_gradients): which are set is in the key, and the
    # graph for a call that finds some takes them as GRADIENT inputs.
    accumulates: bool = False
    groups: list[hyperparams.GroupSpec] = field(default_factory=list)  # what the update assumes of param_groups
    data_parallel: Any = None  # data_parallel.DataParallel of a DDP-wrapped model: its gradients are averaged in the graph
    value_checks: list[Any] = field(default_factory=list)  # value_checks.ValueCheck, by index: what a failed check raises


@dataclass
class TrainGraph:
    """The captured iteration: an fx graph plus what each placeholder and output means.

    `gm(*flat_inputs)` runs one step in place (under no_grad) and returns
    `(outputs, grads)`: `outputs` the tensors train_step returned (flattened; the
    structure is `call.output_spec`), `grads[i]` the final `.grad` of parameter `grad_names[i]`.
    """

    gm: torch.fx.GraphModule
    inputs: list[GraphInput]
    grad_names: list[str]  # parameters whose .grad is still set when train_step returns
    phase: dict[str, Phase]  # node name -> phase, for every call_function node
    loss_node: str
    grad_nodes: dict[str, str]  # parameter name -> node holding its gradient after backward
    has_optimizer: bool
    device: str
    backward_passes: int = 1  # backward() calls per step: micro-batches accumulating gradients
    call: CallContract = field(default_factory=CallContract)
    meta: dict[str, Any] = field(default_factory=dict)
    # Two ways a graph derives from the captured one without copying its module (a copy of
    # tens of thousands of nodes takes a good part of a second). Such a graph runs only as
    # emitted by the rewriter (rewriter.runnable), which applies both:
    # - the op nodes' execution order where it is not gm's own (update_placement.reorder);
    order: list[str] | None = None
    # - backward nodes that write their result into the buffer of the named input, their
    #   op's out= overload (lean_ops), instead of allocating a new one.
    lean_into: dict[str, str] = field(default_factory=dict)

    def runs_another_graph_later(self) -> bool:
        """Whether the step's later calls run another graph than this one: it adds to the
        gradients a call finds set (CallContract.accumulates), and it leaves some set, or
        this graph takes some (the other graph is then the one for none set)."""
        return self.call.accumulates and (bool(self.grad_names) or any(i.kind is InputKind.GRADIENT for i in self.inputs))

    def op_nodes(self) -> list[torch.fx.Node]:
        """The call_function nodes in execution order (rank = index in this list)."""
        ops = [n for n in self.gm.graph.nodes if n.op == "call_function"]
        if self.order is None:
            return ops
        by_name = {n.name: n for n in ops}
        return [by_name[n] for n in self.order]

    def written_args(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The input nodes whose storage `node` writes in place: its op's own
        (op_facts.written_args) and, for a lean variant, the input it writes its result into."""
        written = op_facts.written_args(node)
        into = self.lean_into.get(node.name)
        return written if into is None else written + [a for a in node.all_input_nodes if a.name == into]

    def batch_signature(self) -> list[tuple[tuple[int, ...], str, str]]:
        return [(i.shape, i.dtype, i.device) for i in self.inputs if i.kind is InputKind.BATCH]
