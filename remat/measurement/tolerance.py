"""Compare a step that is not bitwise (compiled regions) with eager PyTorch, under a tolerance.

Three copies take one step from the same state on the same batch and seed: eager in the
model's precision, eager in float64 (the reference), and the step under test. Each tensor
the step leaves (the loss, every parameter, gradient and optimizer state) must then be as
near the float64 reference as eager's own is, by the criterion torch's compiler tests use
for one iteration:

    RMSE(test, float64) <= m * RMSE(eager, float64) + tol / 10,  tol = 1e-4,

m = 2 (3 for tensors under 1,000 elements or in half precision), or within tol of eager
elementwise. The largest |test - eager| is reported beside it. Then eager and the step
under test go on for more steps, and their losses are reported side by side: after the first
step the two runs drift apart as rounding compounds, so those are shown, not judged.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat.capture.optimizers import as_one

TOLERANCE = 1e-4
CRITERION = "RMSE against float64 eager <= 2x eager's own (3x under 1,000 elements or in half precision) + 1e-5, or within 1e-4 of eager"


@dataclass
class ToleranceResult:
    within: bool
    steps: int
    compared: int  # tensors compared, over all steps
    largest_difference: float  # max |test - eager| over them
    largest_where: str
    failures: list[str] = field(default_factory=list)
    criterion: str = CRITERION
    eager_losses: list[float] = field(default_factory=list)  # over the steps after the judged one
    losses: list[float] = field(default_factory=list)

    @property
    def largest_loss_difference(self) -> float:
        """The largest |loss - eager's| over the steps after the judged one (a loss near zero
        makes a relative difference meaningless: a model that learns its one batch)."""
        return max((abs(a - b) for a, b in zip(self.eager_losses, self.losses)), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "within": self.within, "criterion": self.criterion, "tensors_compared": self.compared,
            "largest_difference": self.largest_difference, "largest_difference_at": self.largest_where,
            "eager_losses": self.eager_losses, "losses": self.losses, "largest_loss_difference": self.largest_loss_difference,
        }  # fmt: skip

    def summary(self) -> str:
        head = "within tolerance of eager" if self.within else f"{len(self.failures)} tensors outside the tolerance"
        detail = f"largest |difference| from eager {self.largest_difference:.3g} ({self.largest_where})"
        losses = (
            f"; losses over {len(self.losses)} more steps: eager's {self.eager_losses[0]:.4g} to {self.eager_losses[-1]:.4g}, "
            f"largest difference {self.largest_loss_difference:.3g}"
        ) if self.losses else ""  # fmt: skip
        return f"{head} after {self.steps} step ({self.compared} tensors; {detail}){losses}" + ("" if self.within else "; first: " + "; ".join(self.failures[:3]))


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.sqrt(torch.mean(torch.square(a.double() - b.double())).item())


def _near(test: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> tuple[bool, str]:
    if torch.allclose(test.double(), eager.double(), atol=TOLERANCE, rtol=TOLERANCE, equal_nan=True):
        return True, ""
    multiplier = 3.0 if test.numel() < 1000 or test.dtype in (torch.float16, torch.bfloat16) else 2.0
    test_error, eager_error = _rmse(test, reference), _rmse(eager, reference)
    ok = test_error <= multiplier * eager_error + TOLERANCE / 10
    return ok, f"RMSE from float64 {test_error:.3g}, eager's {eager_error:.3g}"


def _named_tensors(model: torch.nn.Module, optimizer: Any, out: Any) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = {}
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    if leaves:
        named["loss"] = leaves[0].detach()
    params = list(model.named_parameters())
    for name, p in params:
        named[f"parameter {name}"] = p.detach()
        if p.grad is not None:
            named[f"gradient {name}"] = p.grad
    opt = as_one(optimizer)
    if opt is not None:
        for i, (_, p) in enumerate(params):
            for key, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    named[f"optimizer state {i}.{key}"] = v
    return named


def float64_twin(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """A copy in float64 (parameters, buffers and any optimizer state), its optimizer pointing at it."""
    model64, opt64 = copy.deepcopy((model, optimizer))
    model64.double()
    one = as_one(opt64)
    if one is not None:
        for state in one.state.values():
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    state[key] = v.double()
    return model64, opt64


def as_float64(batch: Any) -> Any:
    return pytree.tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch)


def check_within_tolerance(
    train_step: Callable[[torch.nn.Module, Any, Any], Any],
    eager_model: torch.nn.Module,
    eager_opt: Any,
    test_model: torch.nn.Module,
    test_opt: Any,
    test_step: Callable[[Any], Any],
    batch: Any,
    steps: int = 1,
    seed: int = 0,
    loss_steps: int = 0,
) -> ToleranceResult:
    """`steps` steps on the three copies (`eager_*` and `test_*` from the same state; the float64
    copy made here from eager's), everything compared after each; then `loss_steps` more on
    eager and the step under test, their losses kept."""
    model64, opt64 = float64_twin(eager_model, eager_opt)
    batch64 = as_float64(batch)
    failures: list[str] = []
    compared, largest, where = 0, 0.0, "-"
    for i in range(steps):
        runs = []
        for run in (lambda: train_step(eager_model, eager_opt, batch), lambda: train_step(model64, opt64, batch64), lambda: test_step(batch)):
            torch.manual_seed(seed + i)
            runs.append(run())
        eager = _named_tensors(eager_model, eager_opt, runs[0])
        reference = _named_tensors(model64, opt64, runs[1])
        test = _named_tensors(test_model, test_opt, runs[2])
        for name in sorted(set(eager) | set(test)):
            if name not in eager or name not in test or name not in reference:
                failures.append(f"step {i + 1} {name}: on one side only")
                continue
            compared += 1
            difference = (test[name].double() - eager[name].double()).abs().max().item() if test[name].numel() else 0.0
            if difference > largest or math.isnan(difference):
                largest, where = difference, f"step {i + 1} {name}"
            ok, detail = _near(test[name], eager[name], reference[name])
            if not ok:
                failures.append(f"step {i + 1} {name}: {detail}")
    result = ToleranceResult(within=not failures, steps=steps, compared=compared, largest_difference=largest, largest_where=where, failures=failures)
    for i in range(steps, steps + loss_steps):
        for run, into in ((lambda: train_step(eager_model, eager_opt, batch), result.eager_losses), (lambda: test_step(batch), result.losses)):
            torch.manual_seed(seed + i)
            loss = pytree.tree_leaves(run())[0]
            into.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
    return result
