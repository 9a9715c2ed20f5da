"""Compare a remat step with eager PyTorch: bitwise results, and time taken alternately.

Both sides start from identical deep copies of the model and optimizer and see the same
batches under the same seeds, so on CPU every loss, gradient, parameter, buffer and
optimizer state must match to the bit.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat.capture.optimizers import as_one, each


@dataclass
class CheckResult:
    match: bool
    steps: int
    mismatches: list[str] = field(default_factory=list)  # "what: max |difference|"

    def summary(self) -> str:
        if self.match:
            return f"loss, gradients, parameters, buffers and optimizer state equal to eager, bitwise, over {self.steps} steps"
        return f"{len(self.mismatches)} mismatches; first: " + "; ".join(self.mismatches[:5])


def _diff(a: Any, b: Any) -> str | None:
    """How two tensors (or the Python numbers an optimizer's state may hold) differ, or None."""
    if a is None or b is None:
        return None if a is None and b is None else "one side is None"
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if type(a) is type(b) and (a == b or (a != a and b != b)) else f"{a!r} vs {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if torch.equal(a, b):
        return None
    return f"max |diff| {(a.double() - b.double()).abs().max().item():.3g}"


def compare_state(
    model_a: torch.nn.Module,
    opt_a: torch.optim.Optimizer | None,
    model_b: torch.nn.Module,
    opt_b: torch.optim.Optimizer | None,
) -> list[str]:
    """Every difference between two copies of a model and optimizer, named."""
    out: list[str] = []
    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        for what, x, y in (("parameter", pa, pb), ("gradient", pa.grad, pb.grad)):
            d = _diff(x, y)
            if d:
                out.append(f"{what} {name}: {d}")
    for (name, ba), (_, bb) in zip(model_a.named_buffers(), model_b.named_buffers()):
        d = _diff(ba, bb)
        if d:
            out.append(f"buffer {name}: {d}")
    opt_a, opt_b = as_one(opt_a), as_one(opt_b)  # one optimizer, or a list of them
    if opt_a is not None and opt_b is not None:
        pairs = zip(model_a.parameters(), model_b.parameters())
        for i, (pa, pb) in enumerate(pairs):
            sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
            for key in sorted(set(sa) | set(sb)):
                d = _diff(sa.get(key), sb.get(key))
                if d:
                    out.append(f"optimizer state {i}.{key}: {d}")
        # The groups' settings too: a rate or count the step sets or counts there is state the next step reads.
        for gi, (ga, gb) in enumerate(zip(opt_a.param_groups, opt_b.param_groups)):
            for key in sorted((set(ga) | set(gb)) - {"params"}):
                d = _diff(ga.get(key), gb.get(key))
                if d:
                    out.append(f"param_groups[{gi}][{key!r}]: {d}")
    return out


def twin(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """An independent copy of the model and its optimizer (the optimizer pointing at the
    copy), with the gradients set now: deepcopy leaves a parameter's `.grad` behind. An
    optimizer's deepcopy keeps only its defaults, state and groups; the settings a
    library's optimizer keeps as attributes (`self.foreach`) are copied too, but not a
    function held there (a scheduler's wrapper of `step`, bound to the original)."""
    memo: dict[int, Any] = {}
    copied = copy.deepcopy((model, optimizer), memo)
    for original, made in zip(each(as_one(optimizer)), each(as_one(copied[1]))):  # one, or a list
        for key, value in vars(original).items():
            if key not in vars(made) and not callable(value):
                setattr(made, key, copy.deepcopy(value, memo))
    for p, q in zip(model.parameters(), copied[0].parameters()):
        q.grad = None if p.grad is None else p.grad.detach().clone()
    return copied


def check_against_eager(
    train_step: Callable[[torch.nn.Module, Any, Any], torch.Tensor],
    eager_model: torch.nn.Module,
    eager_opt: torch.optim.Optimizer | None,
    remat_model: torch.nn.Module,
    remat_opt: torch.optim.Optimizer | None,
    remat_step: Callable[[Any], torch.Tensor],
    batch: Any,
    steps: int = 3,
    seed: int = 0,
    between_steps: Callable[[int, torch.nn.Module, Any], None] | None = None,
    batches: list[Any] | None = None,
) -> CheckResult:
    """Run `steps` steps on both sides with the same seeds and compare everything after each.

    `between_steps(i, model, optimizer)`, if given, runs on each side after step i: what
    a training loop does between steps (a scheduler, a hand-set learning rate, ...).
    `batches`, if given, are used in turn instead of `batch`.
    """
    mismatches: list[str] = []
    for i in range(steps):
        b = batches[i % len(batches)] if batches else batch
        torch.manual_seed(seed + i)
        out_e = train_step(eager_model, eager_opt, b)
        torch.manual_seed(seed + i)
        out_r = remat_step(b)
        leaves_e, spec_e = pytree.tree_flatten(out_e)
        leaves_r, spec_r = pytree.tree_flatten(out_r)
        if spec_e != spec_r:
            mismatches.append(f"step {i + 1} returned {spec_r}, eager {spec_e}")
        for j, (x, y) in enumerate(zip(leaves_e, leaves_r)):
            if not isinstance(x, torch.Tensor):  # a Python number the step returned
                same = type(x) is type(y) and (x == y or (x != x and y != y))  # NaN is NaN
                d = "" if same else f"{x!r} vs {y!r}"
            else:
                d = _diff(x.detach(), y.detach())
            if d:
                mismatches.append(f"step {i + 1} {'loss' if j == 0 else f'output {j}'}: {d}")
        mismatches += [f"step {i + 1} {m}" for m in compare_state(eager_model, eager_opt, remat_model, remat_opt)]
        if between_steps is not None:
            between_steps(i, eager_model, eager_opt)
            between_steps(i, remat_model, remat_opt)
    return CheckResult(match=not mismatches, steps=steps, mismatches=mismatches)


def eager_differs_from_itself(
    train_step: Callable[[torch.nn.Module, Any, Any], Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    batch: Any, seed: int = 0,
) -> list[str]:
    """What differs between two eager steps from the same state, batch and seed: nothing,
    unless a kernel is nondeterministic (a parallel accumulation whose order varies), in
    which case no comparison with eager can be bitwise."""
    (model_a, opt_a), (model_b, opt_b) = twin(model, optimizer), twin(model, optimizer)
    torch.manual_seed(seed)
    train_step(model_a, opt_a, batch)
    torch.manual_seed(seed)
    train_step(model_b, opt_b, batch)
    return compare_state(model_a, opt_a, model_b, opt_b)


def check_one_graph(tg: Any, tool: str) -> None:
    """Refuse, for a measuring tool that plans and runs one graph over repeated steps, a step
    whose later steps run another: one that adds its gradients to those the step before
    left (gradient accumulation across calls)."""
    from remat.errors import RematError

    if tg.runs_another_graph_later():
        raise RematError(
            "the step adds its gradients to those the step before left (gradient accumulation across calls), so its "
            f"steps after the first run another graph; {tool} measures one. Give it a step that clears the gradients "
            "first (optimizer.zero_grad() before backward), or accumulate inside the step."
        )


@dataclass
class Timing:
    a_seconds: float  # median
    b_seconds: float  # median
    ratio: float  # median of per-pair b / a
    ratio_spread: tuple[float, float]  # min and max of the per-pair ratios
    pairs: int


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_alternating(run_a: Callable[[], Any], run_b: Callable[[], Any], pairs: int = 5, warmup: int = 1, device: str = "cpu") -> Timing:
    """Time two callables in alternation (a, b, a, b, ...) so that machine noise hits both."""
    for _ in range(warmup):
        run_a()
        run_b()
    ta: list[float] = []
    tb: list[float] = []
    for i in range(pairs):
        order = [(run_a, ta), (run_b, tb)] if i % 2 == 0 else [(run_b, tb), (run_a, ta)]
        for fn, acc in order:
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            acc.append(time.perf_counter() - t)
    ratios = [b / a for a, b in zip(ta, tb)]
    return Timing(statistics.median(ta), statistics.median(tb), statistics.median(ratios), (min(ratios), max(ratios)), pairs)


def model_snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What compiling must leave as it found it, comparable with `==`: per module its class,
    train/eval flag, every attribute (a tensor by identity, version and a copy of its values;
    a plain value by value; anything else by identity), every hook table's hooks; per
    parameter its gradient, `requires_grad` and tensor hooks; the process-wide module hooks;
    grad mode and the CPU generator's state."""
    import torch.nn.modules.module as module_globals

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v), v._version, v.detach().clone())
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, (list, tuple)) and len(v) <= 64:
            return (type(v), tuple(value(x) for x in v))
        if isinstance(v, dict) and len(v) <= 256:
            return (type(v), tuple((k if isinstance(k, (str, int)) else id(k), value(x)) for k, x in v.items()))
        if isinstance(v, (set, frozenset)) and len(v) <= 256 and all(isinstance(x, str) for x in v):  # a module's non-persistent buffer names
            return (type(v), tuple(sorted(v)))
        return ("object", id(v))

    out: dict[str, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[f"module {name}"] = (type(m), m.training, tuple(sorted((k, value(v)) for k, v in vars(m).items())))
    for name, p in model.named_parameters(remove_duplicate=False):
        out[f"parameter {name}"] = (p.requires_grad, value(p.grad), tuple(sorted(map(id, (p._backward_hooks or {}).values()))),
                                    tuple(map(id, (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())))
    out["global module hooks"] = tuple(
        (k, tuple(map(id, v.values()))) for k, v in vars(module_globals).items() if k.startswith("_global") and isinstance(v, dict)
    )
    out["grad mode"] = torch.is_grad_enabled()
    out["cpu generator"] = torch.get_rng_state()
    return out


def snapshot_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The entries of two model_snapshot()s that differ, by name."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return bool(a == b)

    return [k for k in {**before, **after} if k not in before or k not in after or not same(before[k], after[k])]
