"""Capture one whole training iteration (forward, backward, optimizer step) as one fx graph.

The user's `train_step(model, optimizer, batch) -> loss` is traced with `make_fx` on fake
tensors. Parameters, buffers, optimizer state and the tensors outside the model that the
user's state holds (`outside_tensors`) are swapped for graph inputs while it runs, so the
graph takes them as placeholders and mutates them in place, exactly as the eager step
would. Markers (a no-op custom op) are dropped into the trace at the start of
`backward()`, after it, and at the start of `optimizer.step()`; they tell each node's
phase, which node is the loss and which nodes are the parameters' gradients, and are
removed before the graph is handed on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from remat.gc_pause import gc_paused
from remat.capture import param_hooks, trace_failures
from remat.capture.distributed import data_parallel, sharded, sharded_norms
from remat.capture.optim import first_step_state, hook_state, hyperparams, optimizer_state
from remat.capture.state import first_call, kept_numbers, kept_tensors, library_objects, logged_numbers, outside_tensors, read_numbers, scheduler_calls, step_outputs, module_hooks, step_prints, train_modes, user_code
from remat.capture.cpu_strides import CpuLikeEager
from remat.errors import CaptureError
from remat.capture.optim.first_step_state import check_first_step_state
from remat.capture.optim.optimizer_state import optimizer_on, optimizer_states
from remat.capture.optimizers import as_one, only_passed_step

from remat.capture.markers import marking_updates, MARKER, RECORD_FUNCTION_OPS, marker, marking_passes
from remat.capture.trace_checks import host_effects_named, branched_hyperparameters, calls_compiled_function, no_dynamic_output_shapes, data_dependent_condition, check_backward_ran, check_graph_runnable, cleared_before_backward, check_static_shapes, drop_unread_inputs, ends_with_zero_grads, drop_unread_new_state, where_in_users_code, where_in_users_code_now
from remat.capture.train_graph import CallContract, GraphInput, InputKind, Phase, TrainGraph, TrainStep
from remat.capture.state.python_state import no_python_state_changed, put_back_as_now, state_slots
from remat.capture.traced_rng import no_host_random_drawn, no_rng_state_set
from remat.capture.user_checkpoints import plain_checkpoints
from remat.ops import check_placement, ctc_loss, dropout_masks, known_values, training_workspace, value_checks
from remat.ops.cpu_shape_functions import cpu_kernels_as_shape_functions
from remat.capture.batch_leaves import BatchValues, batch_leaf_names, graph_leaves, is_counted, set_by_step, warn_batch_set
from remat.capture.step_inputs import accumulated_gradients, call_step, finds_gradients, check_arguments, graph_inputs, held_gradients


def _user_state(
    model: torch.nn.Module, train_step: TrainStep, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]], batch: Any,
) -> tuple[list[Any], dict[int, list[outside_tensors.Location]], list[tuple[outside_tensors.OutsideTensor, torch.Tensor]], dict[str, torch.Tensor]]:  # fmt: skip
    """What the trace swaps in the user's state (python_state's slots, also returned): every
    tensor it holds, by id, with where; those that are not the model's, its optimizer's or
    the batch's (`own`, also returned, by name), each with its tensor now (a graph input,
    dropped after tracing if unread)."""
    slots = state_slots(model, train_step)
    held = outside_tensors.find(slots)
    own = {**params, **buffers, **{f"{n}.{k}": t for n, st in states.items() for k, t in st.items()}}
    own.update((n, t) for n, t in zip(batch_leaf_names(batch), pytree.tree_leaves(batch)) if isinstance(t, torch.Tensor))
    mine = {id(t) for t in own.values()}
    out = [(outside_tensors.OutsideTensor(locs[0].name, tuple(locs)), locs[0].get()) for tid, locs in held.items() if tid not in mine]
    return slots, held, out, own


def _aliases(model: torch.nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> tuple[dict[int, str], dict[str, str], dict[str, str]]:
    """Each parameter's name by its id, and the name of the parameter and buffer each of the model's names for them (tied weights) stands for."""
    real_to_name = {id(p): n for n, p in params.items()}
    buffer_to_name = {id(b): n for n, b in buffers.items()}
    param_alias = {a: real_to_name[id(p)] for a, p in _slots(model, "_parameters")}
    buffer_alias = {a: buffer_to_name[id(b)] for a, b in _slots(model, "_buffers")}
    return real_to_name, param_alias, buffer_alias


def _slots(model: torch.nn.Module, table: str) -> list[tuple[str, torch.Tensor]]:
    """Each parameter (or buffer) slot of the model's modules once, by its first name. A module
    reached by two paths (a library's second reference to it: peft's `word_embeddings`) has
    its slots once: swapped in twice, the second swap would save the traced tensor as the
    one to put back, and leave it in the user's model."""
    seen: set[tuple[int, str]] = set()
    out = []
    for prefix, m in model.named_modules(remove_duplicate=False):
        for leaf, t in getattr(m, table).items():
            if t is not None and (id(m), leaf) not in seen:
                seen.add((id(m), leaf))
                out.append((f"{prefix}.{leaf}" if prefix else leaf, t))
    return out


def _as_stand_ins(t_params: dict[str, torch.Tensor], trainable: tuple[str, ...], grads: dict[str, torch.Tensor], preset: bool) -> None:
    """Each traced parameter requires a gradient as its parameter does, and starts with the
    gradient it adds to (`grads`: GRADIENT inputs) or without one, not the fake copy of its
    real one's `.grad` (a constant of the trace, which zero_grad(set_to_none=False) would
    zero in place, and the graph then write into at every call). `preset`: every trainable
    one starts with zeros instead, marked (accumulates reads whether the step adds to them)."""
    for n, p in t_params.items():
        p.requires_grad_(n in trainable)
        p.grad = grads.get(n)
    if preset:
        for n in trainable:
            t_params[n].grad = torch.zeros_like(t_params[n])
        marker([t_params[n].grad for n in trainable], "preset_grads")


def _trace(
    traced: Callable[..., Any], flat: list[torch.Tensor], symbols: dict[str, str], sign_facts: dict[str, int],
    hyper_values: dict[str, float], numbers: read_numbers.Reading, batch_values: BatchValues, model: torch.nn.Module,
    checks: value_checks.ValueChecks,
) -> torch.fx.GraphModule:  # fmt: skip
    """make_fx of `traced`; a branch on a hyperparameter other than the known ones fixes its
    sign too (in `sign_facts`), and where its sign was not enough for an int, its value (a
    count: `hyperparams.FIXED`), and traces again, from the Python state the first found; so
    does a branch on a number read at every call, a size made of one, or any other failure
    while some are symbols (`Reading`). A float of the batch branched on, or used where only a
    fixed number can go, is refused."""
    modes = [(m, m.training) for m in model.modules()]
    into_compiled = [False]  # a function torch.compile wrapped was called: traced as its plain code

    def make() -> torch.fx.GraphModule:
        with checks.tracing(symbols), hyperparams.quiet_structured_trace(), cpu_kernels_as_shape_functions(), \
                torch._dynamo.config.patch(error_on_nested_fx_trace=not into_compiled[0]):
            return make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=False)(*flat)

    put_back = put_back_as_now()
    while True:
        try:
            gm = make()
            if checks.finished() or numbers.sized(gm, symbols) or batch_values.newly_read() or batch_values.as_values(read_numbers.sizing(gm, symbols)):
                continue
            return gm
        except (Exception, SystemExit) as e:  # noqa: BLE001 - translated into a message a user can act on (sys.exit: a check's failing side)
            put_back()
            if batch_values.newly_read():
                continue
            if not into_compiled[0] and calls_compiled_function(e):
                into_compiled[0] = True
                continue
            branched = branched_hyperparameters(e, symbols)
            if batch_values.decided(branched, data_dependent_condition(e), symbols):  # an int of the batch compared
                continue
            batch_values.refuse_branch(branched, e)
            new = [name for name in branched if name in hyper_values and name not in sign_facts]
            fixed = [name for name in branched if name in hyper_values and sign_facts.get(name, hyperparams.FIXED) != hyperparams.FIXED and type(hyper_values[name]) is int]
            # A setting compared with a count (`step > group["warmup"]`) is decided first: the count's condition is then its own.
            if not new and not fixed and numbers.tripped(branched, not checks.at_check(e) and not any(name in hyper_values for name in branched), data_dependent_condition(e), symbols):
                continue
            if not new and not fixed:
                if checks.retry(e, where_in_users_code(e)):
                    continue
                e = checks.refusal(e)
                if isinstance(e, CaptureError):
                    raise e
                if batch_values.newly_read(failed=True):
                    continue
                batch_values.refuse_use(make, e)
                raise trace_failures.explain_trace_failure(e, model) from e
            sign_facts.update({name: hyperparams.sign(hyper_values[name]) for name in new})
            if not new:
                sign_facts.update({name: hyperparams.FIXED for name in fixed})
        finally:
            train_modes.put_back_modes(modes)
            for module in model.modules():
                if isinstance(module, torch.nn.RNNBase):  # its cached weight list still holds the traced ones
                    module._init_flat_weights()


@gc_paused()
@kept_numbers.with_counts_read(lambda train_step, model, optimizer, *rest, **kw: first_step_state.drop_made_ahead(as_one(optimizer)))
@first_call.with_keys_made(lambda train_step, model, optimizer, *rest, **kw: first_step_state.drop_made_ahead(as_one(optimizer)))
def capture(
    train_step: TrainStep, model: torch.nn.Module, optimizer: Any, example_batch: Any,
    read_numbers_named: frozenset[str] = frozenset(), reduce_in_buckets: bool = True, grads_in: bool = False, batch_read: frozenset[int] = frozenset(),
) -> TrainGraph:
    """Trace one call of `train_step(model, optimizer, batch)` into a TrainGraph. `optimizer`: one, a list of
    those the step steps (capture.optimizers), or None; its state is created here if empty (`init_optimizer_state`),
    and nothing else changes. `read_numbers_named`: the floats and ints (python_state slot names) to read at every
    call where the trace can (read_numbers). `reduce_in_buckets`: a DDP model's gradients all-reduced in DDP's
    buckets, or each on its own (data_parallel.buckets). `grads_in`: the gradients set now are inputs it adds to. `batch_read`: the positions of the batch's plain values traced as themselves (batch_leaves)."""
    passed, optimizer = optimizer, as_one(optimizer)  # the step gets what was passed; remat reads it as one
    leaves, spec, params, buffers, trainable, device = check_arguments(model, example_batch, optimizer)
    dp = data_parallel.data_parallel_of(model, in_buckets=reduce_in_buckets)
    shards = sharded.sharding_of(model)  # called inside sharded.local_view: the model holds the shards
    if shards is not None:
        sharded.check_optimizers(optimizer, model)
    had_state = {id(p) for p, st in optimizer.state.items() if st} if optimizer is not None else set()
    states = optimizer_states(optimizer, params)
    real_to_name, param_alias, buffer_alias = _aliases(model, params, buffers)

    slots, held, outside, own = _user_state(model, train_step, params, buffers, states, example_batch)
    hooks = param_hooks.of(params)  # the user's gradient hooks: traced in, and checked at every call
    numbers = read_numbers.Reading.of(slots, read_numbers_named, set_by_step=optimizer_state.number_slots(optimizer, params))
    entry_grads = held_gradients(params, trainable, dp or shards, grads_in)
    inputs, flat, hyper_values = graph_inputs(params, buffers, states, entry_grads, optimizer, numbers.slots, outside, example_batch, leaves)

    state_keys = [(n, list(st)) for n, st in states.items()]
    grad_order: list[str] = []  # filled while tracing: names of the grads the "grads" marker holds
    final_grads: list[str] = []
    seen: dict[str, Any] = {}  # what the last trace saw: the return value's structure, backward() calls
    probe: dict[str, Any] = {"preset_grads": False, "grads_in": grads_in, "numbers": [], "as_numbers": False, "numbers_unread": frozenset(), "cleared_first": False}  # accumulates; kept_numbers
    # Floats the update branches on keep their sign; `symbols` names one a trace tripped on.
    sign_facts = {n: hyperparams.sign(v) for n, v in hyper_values.items() if hyperparams.parse_input_name(n)[1] in hyperparams.BRANCHED_KEYS}
    sign_facts.update(hyperparams.fixed_by_fused_kernels(optimizer))
    symbols: dict[str, str] = {}
    batch_values, recorded = BatchValues.of(example_batch, leaves, batch_read), _Recorded()  # `recorded`: filled while tracing
    checks = value_checks.ValueChecks()  # branches on tensor values where one side raises: decided over the traces

    def traced(*args: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        no_dynamic_output_shapes(args)
        it = iter(args)
        t_params = {n: next(it) for n in params}
        t_buffers = {n: next(it) for n in buffers}
        t_states = {n: {k: next(it) for k in keys} for n, keys in state_keys}
        t_grads = {n: next(it) for n in entry_grads}
        t_hyper = {n: next(it) for n in hyper_values}
        t_numbers = {n: next(it) for n in numbers.slots}
        t_outside = [next(it) for _ in outside]
        t_batch = pytree.tree_unflatten(t_leaves := batch_values.traced(batch_args := list(it), leaves, symbols), spec)
        _as_stand_ins(t_params, trainable, t_grads, preset=probe["preset_grads"])
        param_hooks.register_on(hooks, t_params)
        calls = {"backward": 0, "reduced": 0, "updates": 0}
        in_groups: list[Any] = []  # numbers the step counts up or sets in the param groups, with their traced values (hyperparams.symbolic)
        synced: list[bool] = []  # per forward of a DDP model: whether it syncs gradients
        passes = marking_passes(t_params, grad_order, calls, dp, synced)
        mapping = {a: t_params[c] for a, c in param_alias.items()}
        mapping.update({a: t_buffers[c] for a, c in buffer_alias.items()})
        with contextlib.ExitStack() as stack:
            stack.enter_context(stateless._reparametrize_module(model, mapping))
            if dp is not None:
                stack.enter_context(data_parallel.traced_forward(model, synced))
            stack.enter_context(sharded.gathered_in_forward(shards))
            stack.enter_context(sharded_norms.norms_across_shards(shards, t_params, params))
            stack.enter_context(only_passed_step(optimizer))
            if optimizer is not None:
                stack.enter_context(optimizer_on(optimizer, real_to_name, t_params, t_states, args))
                stack.callback(optimizer.register_step_pre_hook(marking_updates(calls)).remove)  # before symbolic's: its ops are the update's
                stack.enter_context(hyperparams.symbolic(optimizer, t_hyper, sign_facts, symbols, in_groups))
            stack.enter_context(numbers.traced(t_numbers, symbols, batch_values.symbols))
            stack.enter_context(passes)
            stack.enter_context(cleared_before_backward(calls, cleared := set()))
            known = known_values.KnownValues([(a, r) for a, r, leaf in zip(batch_args, flat[len(flat) - len(batch_args):], graph_leaves(leaves)) if not is_counted(leaf)], where_in_users_code_now, checks, known_values.state_followed(buffers, t_buffers, states, t_states, [(o.name, t, real) for (o, real), t in zip(outside, t_outside)]), lambda: {s: hyper_values[n] for s, n in symbols.items() if n in hyper_values})  # fmt: skip
            stack.enter_context(_step_patches(model, recorded, lambda: calls["updates"] > 0, slots, known, checks.deciding))
            stack.enter_context(outside_tensors.swapped(held, dict(zip(map(id, flat), args))))
            effects = _Effects.recording(stack, slots, probe, lambda: state_slots(model, train_step), args, passed, model, ({**params, **buffers}, {**t_params, **t_buffers}))
            result = call_step(train_step, model, passed, t_batch)
            batch_values.escaped(lambda: [result, *(value for _, value in state_slots(model, train_step))])
            probe["cleared_first"] = {id(t_params[n]) for n in trainable} <= cleared
            outside_tensors.check_no_gradient([held for held, _ in outside], t_outside)
        updates, update_values = effects.updates(probe["numbers_unread"], optimizer_state.kept_by_step(numbers, in_groups, effects.skips))
        outputs, out_spec, returned = step_outputs.as_graph_outputs(result, update_values)
        check_backward_ran(calls["backward"])
        grads = [(n, p.grad) for n, p in t_params.items() if p.grad is not None]
        final_grads[:] = [n for n, _ in grads]
        seen.update(library_read=seen.get("library_read", set()) | effects.library_read, left_alone=effects.left_alone, batch_set=set_by_step(t_batch, t_leaves, spec), output_spec=out_spec, output_numbers=returned, backward_passes=calls["backward"], reduced=calls["reduced"], state_updates=updates, unread_containers=logged_numbers.unread(effects.logged) | effects.dicts.unread, requires_grad_set=train_modes.requires_grad_set(t_params, trainable))
        return outputs, [g for _, g in grads]

    trace = lambda: _trace(traced, flat, symbols, sign_facts, hyper_values, numbers, batch_values, model, checks)  # noqa: E731

    ran: set[Any] = set()  # the user's code the traces ran: the step reads only what it names
    set_ups: list[first_call.SetUp] = []
    gm, probe_gm, recorded_run = _traces(trace, model, train_step, slots, probe, seen, (grad_order, final_grads), ran, device, set_ups, passed)
    kept_numbers.warn_left_alone(seen.get("left_alone", []))  # the last trace's, once
    leaves_zero_grads = bool(final_grads) and ends_with_zero_grads(gm)
    grads_in = grads_in or finds_gradients(probe_gm, probe["cleared_first"], leaves_zero_grads, {n: params[n] for n in trainable}, optimizer, dp or shards)
    if grads_in and not set(entry_grads) & set(trainable) and accumulated_gradients(params, trainable, dp or shards):  # this call finds some: its graph takes them
        first_step_state.drop_made_ahead(optimizer)  # as it was: made again, where read
        return capture(train_step, model, passed, example_batch, read_numbers_named, reduce_in_buckets, grads_in=True, batch_read=frozenset(batch_values.read))
    check_static_shapes(gm)
    check_graph_runnable(gm)
    gm = training_workspace.swap_in(known_values.checked_first(check_placement.state_checks_first(check_placement.hoisted(gm), checks.checks)))
    groups: list[hyperparams.GroupSpec] = []
    if optimizer is not None:
        inputs = drop_unread_new_state(gm, inputs, optimizer, params, had_state)
        check_first_step_state(optimizer, had_state, {id(params[n]) for n in grad_order})
        groups = hyperparams.group_specs(optimizer, real_to_name, sign_facts)
    inputs = drop_unread_inputs(gm, inputs)
    tg = _finish(gm, inputs, grad_order, final_grads, str(spec), optimizer is not None, device)
    sharded.check_shard_reads(tg, shards)
    tg.call.outside = outside_tensors.read_by_graph(inputs, [held for held, _ in outside], device, own)
    numbers.attach(tg)
    if dp is not None:
        data_parallel.attach(tg, dp, synced_last=bool(seen["reduced"]))
    tg.call.output_spec, tg.call.output_numbers, tg.backward_passes, tg.call.state_updates, tg.call.unread_containers, tg.call.requires_grad_set = (
        seen[k] for k in ("output_spec", "output_numbers", "backward_passes", "state_updates", "unread_containers", "requires_grad_set"))
    tg.call.training, tg.call.mode_calls, tg.call.sets_mode_first = train_modes.traced_modes(model, recorded.mode_calls)
    tg.call.scheduler_calls = scheduler_calls.checked(tg, recorded.scheduler_calls, recorded.scheduler_reads)
    tg.call.trainable, tg.call.leaves_zero_grads, tg.call.accumulates, tg.call.groups, tg.call.param_hooks = trainable, leaves_zero_grads, grads_in, groups, hooks
    tg.call.code_read, tg.call.library_read = frozenset(ran) if recorded_run else None, frozenset(seen["library_read"])
    tg.call.set_up, tg.call.value_checks, tg.call.batch_read, tg.call.batch_sides = set_ups, checks.checks, frozenset(batch_values.read), batch_values.sides()
    return tg


def _traces(
    trace: Callable[[], torch.fx.GraphModule], model: torch.nn.Module, train_step: TrainStep, slots: list[Any],
    probe: dict[str, Any], seen: dict[str, Any], grads: tuple[list[str], list[str]], ran: set[Any], device: str, set_ups: list[Any], passed: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule | None, bool]:  # fmt: skip
    """The graph, traced as eager's later steps run (a library's first-call set-up in place:
    module_hooks), and traced once more with the numbers the step keeps counted
    (kept_numbers); and where gradients stay set after the step, the step traced as the next
    one starts, with them set (for accumulates). The user's code that ran goes
    into `ran`, where it could be recorded (the third value: user_code.recording_run);
    Python state and the model's hook tables are left as they were; what the step's first
    run sets once goes into `set_ups` (first_call), the graph traced as the later runs; the
    Python state the hooks of the optimizer `passed` reach, as it was (optim/hook_state)."""
    grad_order, final_grads = grads
    tables, submodules = module_hooks.HookTables.of(model), module_hooks.Submodules.of(model)
    set_up: list[tuple[torch.nn.Module, str]] = []
    probe_gm = None
    recorded = [True]

    def recorded_trace() -> torch.fx.GraphModule:  # a trace the graph may come from: its code recorded
        with user_code.recording_run(ran, device) as recording:
            recorded[0] = recorded[0] and recording
            return trace()

    try:
        with hook_state.unchanged_by_traces(passed), no_python_state_changed(model, train_step, slots) as watch:
            gm = recorded_trace()
            first_call.refuse_made_keys(watch)
            submodules.refuse_replaced()
            if tables.changed():
                set_up = tables.added_attributes()
                gm = module_hooks.traced_as_set_up(recorded_trace, model)
            watch.refuse_traced_tensors()
            again, set_ups[:] = first_call.traced_as_set_up(watch, recorded_trace, gm)
            gm = again if set_ups else gm
            probe["numbers"] = watch.numbers_changed(frozenset((id(m), k) for m, k in set_up))
            gm = kept_numbers.traced_counting(recorded_trace, probe, seen) if probe["numbers"] else gm
            if final_grads and not probe["cleared_first"] and not probe["grads_in"]:
                # Gradients stay set after the step, so the next step starts with them: it must
                # clear them before its backward (the graph computes fresh ones). A step whose
                # zero_grad() cleared them all before its first backward does (no trace needed).
                probe["preset_grads"] = True
                kept = list(grad_order), list(final_grads)
                try:
                    probe_gm = trace()
                finally:
                    grad_order[:], final_grads[:] = kept
    finally:
        tables.put_back(set_up)
        submodules.put_back()
    warn_batch_set(seen.get("batch_set", []))  # the last trace's, once
    return gm, probe_gm, recorded[0]


@dataclass
class _Effects:
    """What the step's Python code does to the user's state while it is traced, recorded:
    numbers logged into lists, numbers kept, prints and logs, tensors kept."""

    logged: Any
    counted: Any
    printed: Any
    tensors: list[tuple[Any, Any]]
    buffers: list[tuple[Any, Any]]  # the buffers it makes (kept_tensors.KeptBuffer), filled as the trace ends
    dicts: kept_tensors.DictsSet  # keys the step sets in the user's dicts
    skips: dict[int, Any]  # GradScaler's skipped updates (optimizer_state.skipped_in_graph)
    passed: Any  # the optimizer argument, whose wrappers keep a skip (Accelerate's)
    inputs: set[int]  # the graph's inputs, by id: a tensor kept or logged is told from them
    library_read: set[tuple[int, str]]  # the library flags the trace read (library_objects.recording_reads)
    left_alone: list[str] = field(default_factory=list)  # warnings: library numbers left as they were (kept_numbers.kept)

    @classmethod
    def recording(
        cls, stack: contextlib.ExitStack, slots: list[Any], probe: dict[str, Any], all_slots: Callable[[], list[Any]], args: tuple[Any, ...],
        passed: Any, model: torch.nn.Module, tensors_and_stand_ins: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    ) -> _Effects:  # fmt: skip
        """Entered after the outside tensors are swapped: a tensor kept where one was is told from its placeholder.
        `tensors_and_stand_ins`: the model's parameters and buffers, and their stand-ins, by name."""
        inputs = set(map(id, args))
        buffers = stack.enter_context(kept_tensors.data_assignments(args, model, slots))  # entered first: `t.data = new` written back last
        # The tensors kept are looked for once the lists and numbers are put back (it walks the state).
        tensors = stack.enter_context(kept_tensors.setting(all_slots, inputs))
        stack.enter_context(kept_tensors.attributes_on(*tensors_and_stand_ins, inputs, tensors))  # those left on them
        return cls(
            stack.enter_context(logged_numbers.recording(logged_numbers.candidates(slots))),
            stack.enter_context(kept_numbers.counting(probe["numbers"], probe["as_numbers"], probe.get("library_ahead", True))),
            stack.enter_context(step_prints.recording()),
            tensors,
            buffers,
            stack.enter_context(kept_tensors.recording_dicts([(slot, slot.get()) for slot, _ in slots], inputs)),
            stack.enter_context(optimizer_state.skipped_in_graph()),
            passed,
            inputs,
            stack.enter_context(library_objects.recording_reads(slot.owner for slot, _ in slots if slot.library)),
        )

    def updates(self, numbers_unread: frozenset[str], counts: list[Any]) -> tuple[list[Any], list[list[Any]]]:
        """The updates to make again after each run (TrainGraph.call.state_updates), with the
        traced values each takes from the graph. The tensors kept come before prints: a
        recorded call may read one from an object it is given (Lightning's `self.log` of a
        torchmetrics metric reads the batch's value the metric's update kept). Prints come
        before the numbers kept: a number the step counts up prints from the slot's number
        before the step. `counts`: what the step did to the numbers read at every call (read_numbers.Reading.kept), with their values."""
        logs, logged_values = logged_numbers.logged(self.logged, self.inputs)
        prints, printed_values = step_prints.recorded(self.printed)
        kept, kept_values, self.left_alone = kept_numbers.kept(self.counted, numbers_unread)
        tensors = [*self.tensors, *self.dicts.kept, *self.buffers]
        skipped, skipped_values = optimizer_state.skipped_steps(self.passed, self.skips)
        return (
            [*logs, *(t for t, _ in tensors), *prints, *kept, *(u for u, _ in counts), *skipped],
            [*logged_values, *([v] for _, v in tensors), *printed_values, *kept_values, *(v for _, v in counts), *skipped_values],
        )


@dataclass
class _Recorded:
    """What train_step's Python code does that the graph cannot hold, made again at each call."""

    mode_calls: list[tuple[str, bool, bool]] = field(default_factory=list)  # train_modes.recorded_mode_calls
    scheduler_calls: list[scheduler_calls.SchedulerCall] = field(default_factory=list)  # scheduler_calls.recorded_scheduler_calls
    scheduler_reads: list[scheduler_calls.SchedulerRead] = field(default_factory=list)  # the rates it read (scheduler.get_last_lr())


@contextlib.contextmanager
def _step_patches(
    model: torch.nn.Module, recorded: _Recorded, updating: Callable[[], bool], slots: list[tuple[Any, Any]], known: known_values.KnownValues,
    deciding: Callable[[], bool],
) -> Iterator[None]:
    """What runs around train_step while it is traced, besides the markers: CPU kernels'
    real strides, CTC loss with static shapes, the values the trace can know (`known`: sizes and branches from the
    batch's, a constant's results), the user's checkpoints as plain calls, refusing generator state set and draws from Python's
    or numpy's generators, `float()` of a traced value, anomaly detection and torch.save named, recording train()/eval() and scheduler.step()."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(CpuLikeEager())
        stack.enter_context(ctc_loss.static_shapes(where_in_users_code_now))
        stack.enter_context(known)
        stack.enter_context(plain_checkpoints())
        stack.enter_context(step_outputs.float_of_a_traced_value_named())
        stack.enter_context(step_outputs.text_of_a_traced_value_named(deciding))
        stack.enter_context(host_effects_named())
        stack.enter_context(user_code.caches_passed_over())
        stack.enter_context(no_rng_state_set())
        stack.enter_context(no_host_random_drawn([(slot.name, value) for slot, value in slots]))
        stack.enter_context(train_modes.recorded_mode_calls(model, recorded.mode_calls))
        stack.enter_context(scheduler_calls.recorded_scheduler_calls(recorded.scheduler_calls, updating, recorded.scheduler_reads))
        yield


def _finish(
    gm: torch.fx.GraphModule, inputs: list[GraphInput], grad_order: list[str], final_grads: list[str], batch_spec: str, has_optimizer: bool, device: str,
) -> TrainGraph:
    """Read the markers into phases, remove them and record_function nodes; dropout masks held as booleans (dropout_masks)."""
    graph = gm.graph
    phase: dict[str, Phase] = {}
    current = Phase.FORWARD
    loss_node: str | None = None
    grad_nodes: dict[str, str] = {}
    to_erase: list[torch.fx.Node] = []
    after_grads: list[str] = []  # nodes since a backward ended: the next micro-batch's forward, if another backward follows
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is MARKER:
            tag = node.args[1]
            tensors = node.args[0]
            if tag == "backward_begin":
                loss_node = tensors[0].name
                current = Phase.BACKWARD
                phase.update(dict.fromkeys(after_grads, Phase.FORWARD))
            elif tag == "grads":
                grad_nodes = {n: t.name for n, t in zip(grad_order, tensors)}
                after_grads = []
            elif tag == "optimizer_begin":
                current = Phase.OPTIMIZER
                after_grads = []
            to_erase.append(node)
            continue
        if current is Phase.BACKWARD and grad_nodes:
            after_grads.append(node.name)
        if node.target in RECORD_FUNCTION_OPS:
            to_erase.append(node)
            continue
        phase[node.name] = current
    for node in reversed(to_erase):  # exits before enters: an enter's only users are exits
        graph.erase_node(node)
    dropout_masks.held_as_bool(gm, phase)
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    assert len(names) == len(inputs), (len(names), len(inputs))
    graph.lint()
    gm.recompile()
    assert loss_node is not None
    return TrainGraph(
        gm=gm, inputs=inputs, grad_names=final_grads, phase=phase, loss_node=loss_node, grad_nodes=grad_nodes,
        has_optimizer=has_optimizer, call=CallContract(batch_spec=batch_spec), device=device,
    )
