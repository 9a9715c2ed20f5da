"""`remat.compile`: the user's training step, captured, planned, rewritten and run.

One compiled graph per batch shape (captured and planned the first time that shape is
seen); a batch of another structure, dtype or device is an error, never a silent
re-trace that trains something else.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from remat import compile_notes, failed_step, ranks
from remat import build as pipeline
from remat.batch_signature import checked_signature, shapes_and_values, signature, values_read, without_devices
from remat.capture.distributed import data_parallel, sharded
from remat.capture.optim import first_step_state, optimizer_state
from remat.capture.optimizers import as_one
from remat.capture.state import first_call, guards, kept_numbers, kept_tensors, read_numbers
from remat.budget import format_bytes, parse_budget
from remat.passes import cuda_graph as cuda_graphs, inductor_regions
from remat.capture.capture import capture
from remat.capture.step_inputs import ModelView, frozen_gradients_taken, run_captured, unique_named
from remat.capture.train_graph import InputKind, TrainGraph, TrainStep
from remat.errors import BudgetError, CaptureError, ChangedSinceCompiled, RematError, StateValueChanged
from remat.profile.allocator import measure_step_peak
from remat.profile.profiler import node_costs, node_peaks
from remat.profile.time_model import OpCosts, StepTime, simulate_time
from remat.planners.evaluate import baseline_of, step_time
from remat.planners.plan import Plan
from remat.planners import DEFAULT_PLANNER, check_planner, make_plan
from remat.profile.profiles import Profile, graph_fingerprint
from remat.capture.call_inputs import CallInputs, gradients_set
from remat.capture.state.library_objects import read_by_trace
from remat.capture.state.python_state import state_slots, step_values
from remat.capture.state.scheduler_calls import make_calls
from remat.memory.simulator import simulate
from remat.step_report import StepReport


# The profile of the last graph whose budget no plan reached. A plan depends on the op times
# measured, so a compile of the same graph right after (at the peak the refusal named as
# reachable) plans on the same times, and finds that plan again.
_REFUSED: dict[str, Profile] = {}


@dataclass
class CompiledGraph:
    tg: TrainGraph
    gm: torch.fx.GraphModule
    report: StepReport
    measured: bool = False
    step_values: tuple[tuple[str, Any], ...] = ()  # the Python values it was traced with (python_state)
    call_inputs: CallInputs | None = None  # its inputs at each call, made at the first
    cuda_graph: cuda_graphs.CudaGraphStep | None = None  # runs gm as a CUDA graph (cuda_graph=True)

    def rekeyed(self, now: tuple[tuple[str, Any], ...], names: set[str]) -> tuple[tuple[str, Any], ...]:
        """Its key, watching `names` too (values its trace did not read), with the values they hold `now`; as it was where a name it watched is not in `now`."""
        held = dict(self.step_values)
        if not held.keys() <= dict(now).keys():
            return self.step_values
        self.step_values = tuple((n, held.get(n, v)) for n, v in now if n in held or n in names)
        return self.step_values

    def inputs(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> tuple[list[torch.Tensor], ModelView]:
        if self.call_inputs is None:
            self.call_inputs = CallInputs(self.tg)
        return self.call_inputs.gather(model, optimizer, batch)


@dataclass
class RematStep:
    """A training step that runs the rewritten graph. Call it with a batch: `loss = step(batch)`."""

    train_step: TrainStep
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None
    memory_budget: str | int | float | None
    planner: str = DEFAULT_PLANNER
    profile_runs: int = 3
    measure: bool = True  # measure the allocator's peak on the first step of each shape
    progress: bool = False
    profile_cache: dict[str, Profile] | None = None  # graph fingerprint -> profile, shared with other steps (see remat.build)
    # Let the planner run each private optimizer update as soon as its gradient is final. The gradient
    # then dies early; a step that fails in the backward pass may have updated some parameters (the error says which).
    updates_in_backward: bool = True
    # Let backward ops write their result into an input buffer that dies there (the same kernel's out= overload: bitwise, one buffer fewer).
    lean_ops: bool = True
    backend: str = "eager"  # or "inductor": the plan's regions compiled (passes.inductor_regions), not bitwise
    cuda_graph: bool = False  # replay the graph as a CUDA graph after its first call (passes.cuda_graph)
    _graphs: dict[Any, CompiledGraph] = field(default_factory=dict)
    _structure: str | None = None
    _batch_read: frozenset[int] = frozenset()  # positions of the batch's plain values a graph reads: their values in the key
    _batch_sides: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # the batch's ints a graph compares: their sides in the key
    _last: CompiledGraph | None = None
    _unkeyed: set[str] = field(default_factory=set)  # slots the step updates and never reads (TrainGraph.call.state_updates)
    _read: set[str] = field(default_factory=set)  # numbers the loop changed between steps, and the optimizer state's: read at every call (read_numbers)
    _constant: set[str] = field(default_factory=set)  # such floats the step branches on: constants of the graph
    _unread_for_budget: dict[str, int] = field(default_factory=dict)  # numbers constant as reading them needs this budget
    _keys: read_numbers.KeyRules = field(default_factory=read_numbers.KeyRules)  # what the key holds of them (a float's sign, an int's conditions)
    _ran: frozenset[Any] | None = None  # the user's code the traces ran (None before the first): the key watches what it names
    _all_code: bool = False  # a capture could not record the code it ran: watch all the step's code can reach
    _reduce_per_gradient: bool = False  # a DDP step whose gradient buckets made the budget unreachable: gradients all-reduced one by one
    _set_up: list[Any] = field(default_factory=list)  # first_call.SetUp of the graphs compiled since the last call, made at the next
    _default_keys: list[Any] = field(default_factory=list)  # keys the graphs' steps make in defaultdicts: made before each call's key is read
    _hit: tuple[Any, guards.Guards, CompiledGraph] | None = None  # the last graph found, and what its key was found from (guards)
    _accumulating: list[torch.Tensor] | None = None  # a step that adds to gradients it finds set: its parameters, whose .grad set or not is in the key
    _frozen_graded: list[torch.Tensor] = field(default_factory=list)  # frozen parameters whose gradient a graph takes: set or not is in the key
    _library_read: frozenset[tuple[int, str]] = frozenset()  # library fields the traces read (a library's flag): in the key
    _branches: list[Any] = field(default_factory=list)  # the graphs' CountedBranch and KeptBuffer: a library count's branch, a made buffer, in the key

    def __post_init__(self) -> None:
        # Parse now: a bad budget is an error at compile time, not at the first step.
        self._budget = parse_budget(self.memory_budget) if self.memory_budget is not None else None
        inductor_regions.check_backend(self.backend)
        check_planner(self.planner)
        if isinstance(self.profile_runs, bool) or not isinstance(self.profile_runs, int) or self.profile_runs < 1:
            raise RematError(f"profile_runs must be a whole number of at least 1 (runs timed per node), got {self.profile_runs!r}")
        # A DDP or FSDP2 model: every rank compiles and runs the same graph, agreed stage by stage (remat.ranks).
        self._sharded = sharded.is_sharded(self.model)
        shards = sharded.sharding_of(self.model) if self._sharded else None
        self._dp = data_parallel.data_parallel_of(self.model) or (shards.ranks() if shards else None)
        if self._dp is not None and self.backend != "eager":
            raise RematError(f"backend {self.backend!r} is not supported with DDP or FSDP2; use backend='eager'")
        if self._dp is not None and self.cuda_graph:
            raise RematError("cuda_graph=True is not supported with DDP or FSDP2 (their collectives run outside the graph); use cuda_graph=False")

    @property
    def report(self) -> StepReport:
        return self._compiled_last().report

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._compiled_last().gm

    def _compiled_last(self) -> CompiledGraph:
        if self._last is None:
            raise RematError("nothing compiled yet: call the step with a batch first")
        return self._last

    def compiled_for(self, batch: Any) -> CompiledGraph:
        """The compiled graph for this batch's shape, compiling it if it is new."""
        sig = self._agreed("reading the batch", lambda: self._checked_signature(batch), summary=without_devices, differ="the batch's shapes and dtypes")
        shapes = self._with_call_state(sig)
        first_call.make(self._set_up)  # the first run's set-up of a graph compiled before: its key holds it
        self._set_up = []
        first_call.make_keys(self._default_keys)  # as the step's read makes them: its key holds them
        same_state = self._hit is not None and self._hit[1].hold()
        if same_state and self._hit[0] == shapes:
            return self._hit[2]  # the Python state the key was found from is as it was
        if not same_state:
            # The model's tree of modules may have changed (the guards check it,
            # call_inputs does not): the next call of each graph gathers its inputs in full.
            for graph in self._graphs.values():
                graph.call_inputs = None
        slots = self._slots()
        now = self._key_values(slots)
        cached = self._graphs.get((shapes, now))
        if cached is not None:
            self._hit = (shapes, guards.Guards.of(self.model, slots, self._unkeyed, self._read, self._keys, self._library_read), cached)
            return cached
        self._hit = None
        same_shape = [g for (s, _), g in self._graphs.items() if s == shapes]
        before = same_shape[-1].step_values if same_shape else ()
        # Floats and ints changed since: read at every call from now on, compiled once more,
        # then only for an int's new side of a comparison the step makes (read_numbers).
        last = dict(before)
        promoted = {n for n, v in now if type(v) in (float, int) and type(last.get(n)) is type(v) and v != last[n]} - self._constant
        self._read |= promoted
        self._warn_changed(before)
        try:
            compiled = self._compile(batch)
        except BudgetError as error:
            if not promoted:
                raise
            # Their inputs add a few bytes, over a budget at the very peak: constants, as before.
            self._read -= promoted
            self._constant |= promoted
            self._unread_for_budget.update(dict.fromkeys(promoted, error.reach.best if error.reach is not None else None))
            self._warn_changed(before)
            compiled = self._compile(batch)
        else:
            if promoted:  # the graphs holding them as constants are never used again
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != shapes}
        tg = compiled.tg
        known = {b.slot.name for b in self._branches}
        branches = [u for u in tg.call.state_updates if isinstance(u, (kept_numbers.CountedBranch, kept_tensors.KeptBuffer)) and u.slot.name not in known]
        frozen = [p for p in frozen_gradients_taken(tg, self.model) if all(p is not q for q in self._frozen_graded)]
        sides = {i: (*self._batch_sides.get(i, ()), *(c for c in conds if c not in self._batch_sides.get(i, ()))) for i, conds in tg.call.batch_sides.items()}
        if tg.call.batch_read - self._batch_read or sides.items() - self._batch_sides.items():  # from now on, their values (or sides) are in the key
            self._batch_read |= tg.call.batch_read
            self._batch_sides = {**self._batch_sides, **sides}
            sig = self._checked_signature(batch)
            shapes = self._with_call_state(sig)
        if (tg.call.accumulates and self._accumulating is None) or branches or frozen:  # from now on, these are in the key
            if tg.call.accumulates and self._accumulating is None:
                self._accumulating = [p for n, p in self.model.named_parameters() if n in set(tg.call.trainable)]
            self._branches, self._frozen_graded = self._branches + branches, self._frozen_graded + frozen
            shapes = self._with_call_state(sig)
        # What the traces ran, where every capture recorded it; else all the step's code can reach.
        self._all_code = self._all_code or tg.call.code_read is None
        self._ran = None if self._all_code else (self._ran or frozenset()) | tg.call.code_read
        newly_read, self._library_read = tg.call.library_read - self._library_read, self._library_read | tg.call.library_read
        self._unkeyed |= {update.slot.name for update in tg.call.state_updates if not update.keyed} | tg.call.unread_containers  # changed at every call
        constant = {n for n in self._read if n not in tg.call.numbers and n not in tg.call.number_signs and n not in tg.call.number_conditions}  # the trace branches on them
        self._read -= constant
        self._constant |= constant
        self._keys.learn(tg.call.number_signs, tg.call.number_conditions)
        self._read |= set(tg.call.number_conditions)  # and those the step counts up itself, read at every call
        with first_call.applied(tg.call.set_up), first_call.keys_made(tg.call.default_keys):
            compiled.step_values = self._key_values()
        self._set_up += tg.call.set_up
        known = {key.name for key in self._default_keys}
        self._default_keys += [key for key in tg.call.default_keys if key.name not in known]
        self._structure = signature(batch)[0]
        if newly_read:  # the graphs before did not read these library flags: right whatever they hold, keyed with them now
            self._graphs = {(s, g.rekeyed(compiled.step_values, self._library_slots(newly_read))): g for (s, _), g in self._graphs.items()}
        self._graphs[(shapes, compiled.step_values)] = compiled
        wrapped = self._with_call_state(None) is not None
        compile_notes.warn_many_graphs(shapes_and_values([s[0] if wrapped else s for s, _ in self._graphs], sig), values_read(batch, self._batch_read), compiled.report.compile_seconds)
        return compiled

    def _with_call_state(self, shapes: Any) -> Any:
        """The key's shapes, with which gradients are set for a step that adds to them or of
        the frozen parameters a graph takes, and the branch each library count picks."""
        if self._accumulating is None and not self._branches and not self._frozen_graded:
            return shapes
        gradients = gradients_set(self._accumulating) if self._accumulating is not None else None
        return (shapes, gradients, gradients_set(self._frozen_graded), tuple(branch.branch() for branch in self._branches))

    def _slots(self) -> list[Any]:
        """The Python state the graphs depend on (python_state's), and the numbers the optimizer's state holds."""
        return [*state_slots(self.model, self.train_step, self._ran), *optimizer_state.number_slots(as_one(self.optimizer), unique_named(self.model.named_parameters()))]

    def _library_slots(self, fields: frozenset[tuple[int, str]]) -> set[str]:
        """The names of the library slots holding these fields (library_objects.read_by_trace)."""
        return {slot.name for slot, _ in state_slots(self.model, self.train_step, self._ran) if slot.library and read_by_trace(slot, fields)}

    def _warn_changed(self, before: tuple[tuple[str, Any], ...]) -> None:
        """Name the values, changed since the last graph of this shape was compiled, that
        the graph about to be compiled holds as constants (not the floats read at every call)."""
        unread = lambda values: tuple((name, value) for name, value in values if name not in self._read)  # noqa: E731
        now = self._key_values()
        moved = [n for n, v in now if type(v) in (int, float) and n in self._constant and dict(before).get(n) != v]
        needs = max((self._unread_for_budget[n] for n in moved if self._unread_for_budget.get(n)), default=None)
        compile_notes.warn_constants_changed(unread(before), unread(now), bool(moved), needs)

    def _key_values(self, slots: list[Any] | None = None) -> tuple[tuple[str, Any], ...]:
        """The watched values the compiled graph depends on: each value itself, but for a
        number read at every call only whether it is a float, and its sign where the
        graph assumes it. `slots`: python_state.state_slots, where just walked."""
        values = step_values(self.model, self.train_step, skip=self._unkeyed - self._read, ran=self._ran, slots=self._slots() if slots is None else slots, library_read=self._library_read)
        return tuple((name, self._keys.key(name, value)) if name in self._read else (name, value) for name, value in values)

    def _checked_signature(self, batch: Any) -> Any:
        return checked_signature(batch, self._batch_read, self._batch_sides, self._structure, self._graphs)

    def _agreed(self, what: str, fn: Any, summary: Any = None, differ: str = "") -> Any:
        """`fn()`; for a data-parallel step, on every rank together (remat.ranks.together),
        and where `summary` is given, with its value the same on every rank."""
        if self._dp is None:
            return fn()
        result, summaries = ranks.together(self._dp, what, fn, summary or (lambda _: None))
        if summary is not None:
            ranks.same_everywhere(summaries, differ)
        return result

    def _compile(self, batch: Any) -> CompiledGraph:
        start = time.perf_counter()
        tg = self._agreed(
            "capturing the step",
            lambda: capture(
                self.train_step, self.model, self.optimizer, batch, frozenset(self._read), reduce_in_buckets=not self._reduce_per_gradient,
                grads_in=self._accumulating is not None, batch_read=self._batch_read,
            ),
            summary=graph_fingerprint, differ="the captured graph",
        )  # fmt: skip
        if self.cuda_graph:
            cuda_graphs.check_replayable(tg)
        refused = _REFUSED.pop(graph_fingerprint(tg), None) if self.profile_cache is None else None
        built = pipeline.build_on(
            tg, self.model, self.optimizer, batch, runs=self.profile_runs, progress=self.progress, profile_cache=self.profile_cache,
            saved_profile=refused,
        )
        analysis, prof, index = built.analysis, built.profile, built.index
        if self.cuda_graph:
            index.forbid_replay("a replay sets the generator's state on the host, which a CUDA graph cannot capture")
        costs = prof.op_costs().replayed() if self.cuda_graph else prof.op_costs()
        if self._dp is not None:  # one memory model on every rank: rank 0's measured scratch
            index.scratch = ranks.from_root(self._dp, index.scratch)
        baseline = simulate(analysis, scratch=index.scratch)
        plan: Plan | None = None
        budget_bytes: int | None = None
        if self._budget is None:
            gm, phase = tg.gm, tg.phase
            predicted = baseline.peak_bytes
            predicted_time = step_time(index, baseline_of(index).schedule, costs)
        else:
            budget_bytes = self._budget.to_bytes(baseline.persistent_bytes, baseline.step_peak_bytes)
            # Priced as issued op by op even when replayed as a CUDA graph: the plans measured on a GPU.
            node_seconds = prof.seconds_by_node()

            def make() -> Plan:
                return make_plan(
                    self.planner, index, node_seconds, budget_bytes, updates_in_backward=self.updates_in_backward, lean_ops=self.lean_ops
                )

            try:
                plan = make() if self._dp is None else ranks.share_plan(self._dp, make)
            except BudgetError as error:
                earlier = self._budget.for_later_shape(budget_bytes, (g.report.budget_bytes or 0 for g in self._graphs.values()))
                if earlier is None:
                    compile_notes.note_fraction_reached(error, self._budget, baseline.persistent_bytes, baseline.step_peak_bytes)
                    compile_notes.note_gradients_held(error, tg)
                    if self._dp is None or self._reduce_per_gradient or not data_parallel.reduces_in_buckets(tg.gm):
                        _REFUSED.clear()
                        _REFUSED[graph_fingerprint(tg)] = prof
                        raise
                    # Every rank got this error (rank 0 plans for all): every rank captures again.
                    self._reduce_per_gradient = True
                    warnings.warn(
                        "remat: with DDP's gradient buckets no plan fits the budget (a bucket's gradients stay alive until "
                        "the bucket is reduced); the step is compiled again with each gradient all-reduced on its own: "
                        "more collectives, less memory",
                        stacklevel=3,
                    )
                    return self._compile(batch)
                shapes = ", ".join(str(tuple(shape)) for shape, _, _ in signature(batch)[1])
                warnings.warn(
                    f"remat: for the batch shaped {shapes}, {self._budget.describe()} is {format_bytes(budget_bytes)}, "
                    f"below any plan's peak; it is planned under {format_bytes(earlier)}, the budget of a batch shape "
                    "compiled before, so the step holds no more memory than it already did",
                    stacklevel=5,  # the user's call of the step
                )
                budget_bytes = earlier
                plan = make() if self._dp is None else ranks.share_plan(self._dp, make)

            def rewritten() -> tuple[int, torch.fx.GraphModule, dict, StepTime]:
                applied = plan.apply(index)
                return applied.peak_bytes, applied.runnable(), applied.index.tg.phase, step_time(applied.index, applied.schedule, costs)

            predicted, gm, phase, predicted_time = self._agreed("applying the plan", rewritten)
        timed: dict[torch.fx.GraphModule, OpCosts] = {}  # each graph timed once: the last one timed is often the one that runs
        costs_of = lambda g: timed[g] if g in timed else timed.setdefault(g, node_costs(g, tg, self.model, self.optimizer, batch))  # noqa: E731
        gm = inductor_regions.for_backend(
            self.backend, gm, phase, bound_bytes=(budget_bytes or predicted) - baseline.persistent_bytes, progress=self.progress,
            node_peaks=lambda g: node_peaks(g, tg, self.model, self.optimizer, batch),
            node_seconds=lambda g: costs_of(g).seconds_by_node(),
        )  # fmt: skip
        if self.backend != "eager":  # the compiled regions timed as nodes of the graph that runs
            measured_regions = gm.meta["regions"].measured_peak_bytes
            if measured_regions is not None:  # each region's peak measured as one node's: its temporaries are Inductor's
                predicted = max(predicted, baseline.persistent_bytes + measured_regions)
            region_costs = costs_of(gm)
            region_costs = region_costs.replayed() if self.cuda_graph else region_costs
            predicted_time = simulate_time(list(region_costs.host.values()), list(region_costs.device.values()), region_costs.synchronous)
        report = StepReport(
            profile=prof, plan=plan, budget_bytes=budget_bytes, baseline_peak_bytes=baseline.peak_bytes, predicted_peak_bytes=predicted,
            persistent_bytes=baseline.persistent_bytes, num_recomputed=plan.num_recomputed if plan else 0,
            copies=sum(1 for n in gm.graph.nodes if n.name.endswith("_recomputed")),
            compile_seconds=time.perf_counter() - start,
            backend=self.backend,
            regions=len(gm.meta["regions"].regions) if "regions" in gm.meta else 0,
            region_splits=gm.meta["regions"].splits if "regions" in gm.meta else 0,
            regions_slower=gm.meta["regions"].slower if "regions" in gm.meta else 0,
            predicted_time=predicted_time,
            cuda_graph=self.cuda_graph,
        )
        runner = cuda_graphs.CudaGraphStep(gm, tg.inputs, cuda_graphs.CudaBackend(torch.device(tg.device))) if self.cuda_graph else None
        return CompiledGraph(tg=tg, gm=gm, report=report, cuda_graph=runner)

    def __call__(self, batch: Any) -> torch.Tensor:
        with self._on_shards():
            return self._call(batch)

    def _on_shards(self) -> Any:
        """An FSDP2 model's parameters and state held as their local shards (sharded.local_view)."""
        return sharded.local_view(sharded.sharding_of(self.model) if self._sharded else None, self.optimizer)

    def _call(self, batch: Any) -> torch.Tensor:
        compiled = self.compiled_for(batch)
        make_calls(compiled.tg.call.scheduler_calls, before_update=True)  # read by this step's update, as in eager
        try:
            inputs, view = self._agreed("reading the step's inputs", lambda: self._inputs(compiled, batch))
            return self._execute(compiled, inputs, view)
        except (ChangedSinceCompiled, StateValueChanged) as change:
            # Not under DDP or FSDP2 (every rank would compile again; they set up what they reduce for the
            # parameters trained as they were), nor where a graph took gradients, let go of as it ran.
            took_gradients = isinstance(change, StateValueChanged) and any(i.kind is InputKind.GRADIENT for i in compiled.tg.inputs)
            if self._dp is not None or not getattr(change, "before_any_change", True) or took_gradients:
                if self._dp is not None and getattr(change, "before_any_change", False):
                    change.add_note(StateValueChanged.UNDER_DATA_PARALLEL)
                raise
            compiled = self._compiled_again(compiled, batch, change)
            return self._execute(compiled, *self._inputs(compiled, batch))  # the scheduler calls before the update were made

    def _execute(self, compiled: CompiledGraph, inputs: list[torch.Tensor], view: ModelView) -> Any:
        """One step of `compiled`; its first is measured, and its peak compared with the prediction."""
        self._last = compiled
        if compiled.tg.call.data_parallel is not None:
            data_parallel.before_step(self.model)
        if self.measure and not compiled.measured:
            # What the step's updates replace is let go after the measured run (inside, the profiler warns).
            replaced = [update.slot.get() for update in compiled.tg.call.state_updates if hasattr(update, "slot")]  # noqa: F841
            measured = measure_step_peak(lambda: self._run(compiled, inputs, view), compiled.tg.device, self.model)
            compiled.measured = True
            over = compiled.report.take_measured(measured, str(compiled.tg.device), self._dp is not None)
            if over is not None:
                warnings.warn(over, stacklevel=4)  # the user's call of the step
            return measured.result
        return self._run(compiled, inputs, view)

    def _compiled_again(self, stale: CompiledGraph, batch: Any, change: ChangedSinceCompiled | StateValueChanged) -> CompiledGraph:
        """A graph for the parameters trained and the optimizer's groups as they are now, in `stale`'s place."""
        warnings.warn(f"remat: {change.change}: the step is compiled again for it.", stacklevel=4)  # the user's call of the step
        self._graphs, self._hit = {k: g for k, g in self._graphs.items() if g is not stale}, None
        first_step_state.drop_made_ahead(as_one(self.optimizer))  # made for the stale graph, before any run: made anew
        return self.compiled_for(batch)

    def _inputs(self, compiled: CompiledGraph, batch: Any) -> tuple[list[torch.Tensor], ModelView]:
        last = compiled.call_inputs and compiled.call_inputs.last
        inputs, view = compiled.inputs(self.model, self.optimizer, batch)
        if last is not None and compiled.call_inputs.last is not last:
            # Gathered in full again: something changed, and the other graphs' last inputs
            # may hold tensors the user let go (a replaced parameter, an optimizer's old state).
            for other in self._graphs.values():
                if other is not compiled:
                    other.call_inputs = None
        return inputs, view

    def _run(self, compiled: CompiledGraph, inputs: list[torch.Tensor], view: ModelView) -> torch.Tensor:
        """One step; on failure, its error says what the step had already changed in place."""
        dp = compiled.tg.call.data_parallel
        try:
            after = lambda: make_calls(compiled.tg.call.scheduler_calls, before_update=False)  # noqa: E731
            result = run_captured(compiled.tg, compiled.cuda_graph or compiled.gm, self.model, inputs, view, after)
        except Exception as e:
            failed_step.note_changes(e, compiled.tg, compiled.gm)
            if dp is not None:
                ranks.note_collective_failure(e, dp)
            raise
        first_step_state.made_ahead_used(as_one(self.optimizer))
        if dp is not None:
            data_parallel.after_step(self.model, dp)
        if isinstance(compiled.cuda_graph, cuda_graphs.CudaGraphStep):  # (a stand-in while its call is timed)
            compiled.report.cuda_graph_captures = compiled.cuda_graph.captures
            compiled.report.cuda_graph_pool_bytes = compiled.cuda_graph.pool_bytes
        return result


def compile(  # noqa: A001 - the public name mirrors torch.compile
    train_step: TrainStep,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None,
    example_batch: Any,
    memory_budget: str | int | float | None = None,
    planner: str = DEFAULT_PLANNER,
    *,
    profile_runs: int = 3,
    measure: bool = True,
    progress: bool = False,
    profile_cache: dict[str, Profile] | None = None,
    updates_in_backward: bool = True,
    lean_ops: bool = True,
    backend: str = "eager",
    cuda_graph: bool = False,
) -> RematStep:
    """Compile `train_step(model, optimizer, batch) -> loss` into a step that fits `memory_budget`.

    `optimizer`: the one the step steps, or a list of those it steps (each parameter in one
    of them: Muon for the matrices and AdamW for the rest), which train_step gets as given.

    `memory_budget`: a fraction in (0, 1] of the activation peak without recomputation,
    an absolute cap on the whole peak (bytes, or "6GiB"), or None for no recomputation.
    `updates_in_backward`: the planner may run each optimizer update that reads only its
    own parameter, gradient and state as soon as that gradient is final (freeing it);
    the step still leaves bitwise what eager leaves.
    `lean_ops`: backward ops may write their result into an input buffer that dies there
    (passes.lean_ops), where the kernel has an out= form: the same values, fewer bytes.
    `backend`: "eager" runs the plan op by op, bitwise like eager PyTorch; "inductor" compiles
    the plan's regions with Inductor (fused kernels, the plan's order and frees kept; not bitwise).
    `cuda_graph`: on a GPU, after the first call, replay the step as one CUDA graph (static
    shapes; the batch copied into the graph's buffers; random ops not recomputed; a changed
    hyperparameter or a moved tensor captures again): passes/cuda_graph.py.
    The example batch is compiled right away, so errors surface here.
    """
    step = RematStep(
        train_step=train_step, model=model, optimizer=optimizer, memory_budget=memory_budget, planner=planner, profile_runs=profile_runs,
        measure=measure, progress=progress, profile_cache=profile_cache, updates_in_backward=updates_in_backward, lean_ops=lean_ops,
        backend=backend, cuda_graph=cuda_graph,
    )
    with step._on_shards():
        step._last = step.compiled_for(example_batch)
    return step
