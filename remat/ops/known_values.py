"""Values the trace can know: the batch's, and the constants the step makes.

The trace runs on fake tensors, whose values it does not know, and one captured graph
needs every size. Some models size a tensor by what the batch holds. BART's sequence
classifier takes the hidden state at each end-of-sequence token (`hidden[input_ids.eq(eos),
:]`), after checking with `unique_consecutive` that every row has as many; DeBERTa's loss
keeps the examples whose label is not negative (`(labels >= 0).nonzero()`). Others read a
constant they made as Python: DINO's multi-crop wrapper counts its crops' sizes with
`unique_consecutive(torch.tensor(sizes), return_counts=True)` and slices a list by them.

Those values come from the batch, which is at hand, or from Python numbers. While the
step is traced, `KnownValues` follows the real tensors beside the fake ones: the batch's,
and what a factory makes from plain Python numbers (`torch.tensor([...])`, `arange`),
through every op that reads nothing else (a comparison, a sum, a view).

- An op whose output size comes from values (nonzero, argwhere, indexing by a boolean
  mask, unique and unique_consecutive of integers) on the batch's values takes the size
  their real value gives (`nonzero_static`, `remat::unique_fixed`), and the graph checks
  that every batch gives the same size (`remat::size_check`), first thing in the step
  (`checked_first`), raising `BatchValueChanged`, which names the line, before the step changes
  anything.
- On constants alone, such an op's result is a constant of the graph, and a Python number
  read from one (`.item()`, `.tolist()`, an index) is that number: the same at every call.
- A Python branch on the batch's values that goes on either way (value_checks refuses
  such real control flow) takes the side the example batch gives (`truth`), checked at
  every call by its value check, which raises `BatchValueChanged` (Longformer's
  `if is_global_attn:`, from the attention mask through `.item()`).

Random ops and uninitialised memory (`empty`) are not followed. A write in place that
reads only known values is made on the real tensors too (never on the batch's own, the
user's); any other ends the following of what shares the written storage.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import sympy
import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

from remat.errors import BatchValueChanged
from remat.ops import op_facts


@torch.library.custom_op("remat::size_check", mutates_args=())
def size_check(count: torch.Tensor, expected: int, where: str, first: bool, advice: str = "") -> None:
    """Raise `BatchValueChanged` where `count` is not `expected` (`first`: the step has changed nothing yet;
    `advice`: what to do, where the usual advice does not fit)."""
    found = int(count)
    if found != expected:
        stopped = (
            "The step stopped before it changed anything."
            if first
            else "The step stopped there; what it had changed before (a BatchNorm's running statistics, the random generator) stays changed."
        )
        if advice:
            raise BatchValueChanged(f"remat: an op of train_step{where} makes {found} elements, where the compiled step holds {expected}. {advice} {stopped}")
        raise BatchValueChanged(
            f"remat: an op of train_step{where} makes {found} elements from this batch's values, where the compiled step "
            f"holds {expected}, the number the batch it was compiled with gave: remat fixes a size made from the batch's "
            f"values at the compiled batch's and checks it at every call. {stopped} Give every batch the same count (for "
            "a model's own pooling or loss, the same number of end-of-sequence tokens per row, no negative labels), or "
            "compute it with masked ops that keep the shape (torch.where, a loss's ignore_index) in your own code."
        )


@size_check.register_fake
def _(count: torch.Tensor, expected: int, where: str, first: bool, advice: str = "") -> None:
    return None


SIZE_CHECK_OP = torch.ops.remat.size_check.default
torch.fx.node.has_side_effect(SIZE_CHECK_OP)


@torch.library.custom_op("remat::unique_fixed", mutates_args=())
def unique_fixed(x: torch.Tensor, size: int, consecutive: bool) -> torch.Tensor:
    """torch.unique (sorted) or torch.unique_consecutive of `x`, whose size a check before it
    fixed; copied out of unique_consecutive's storage, which keeps the input's size."""
    return torch.unique_consecutive(x).clone() if consecutive else torch.unique(x)


@unique_fixed.register_fake
def _(x: torch.Tensor, size: int, consecutive: bool) -> torch.Tensor:
    return x.new_empty((size,))


@torch.library.custom_op("remat::bincount_fixed", mutates_args=())
def bincount_fixed(x: torch.Tensor, weights: torch.Tensor | None, size: int) -> torch.Tensor:
    """torch.bincount of `x` at `size` bins, a size a check before it fixed (no value reaches it)."""
    return torch.bincount(x, weights, minlength=size)


@bincount_fixed.register_fake
def _(x: torch.Tensor, weights: torch.Tensor | None, size: int) -> torch.Tensor:
    return x.new_empty((size,), dtype=_bincount_dtype(weights))


def _bincount_dtype(weights: torch.Tensor | None) -> torch.dtype:
    """bincount's result dtype: counts are int64; weighted sums are float32 for float32 weights, else float64."""
    return torch.int64 if weights is None else (torch.float32 if weights.dtype == torch.float32 else torch.float64)


# Writes in place, by name (`add_`, `__iadd__`, `__setitem__`): what they write is no longer known.
_IN_PLACE = re.compile(r"^(?!__).*[^_]_$|^__i(add|sub|mul|truediv|floordiv|mod|pow|and|or|xor|lshift|rshift|matmul)__$|^__setitem__$")
# Ops whose values the example does not tell, by name: random draws, uninitialised memory.
_UNKNOWN = re.compile(r"rand|bernoulli|dropout|normal|multinomial|uniform|exponential|geometric|cauchy|poisson|shuffle|empty")
# Python numbers read from a tensor: of a constant, the number itself.
_TO_PYTHON = frozenset({"item", "tolist", "__index__", "__int__", "__float__", "__bool__"})
_MOST_FOLLOWED = 1 << 22  # elements: a larger tensor's real value is not made beside the trace
_MOST_STATE_FOLLOWED = 16  # elements of a buffer followed from its value (a flag, a counter; not statistics)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _number_tensor(number: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
    """`torch.tensor(x)` of a number the trace holds as a symbol (ASGD's `torch.as_tensor(lr /
    ...)` of its step count), which torch can only make of a value it knows: the same
    0-dim tensor, made in the graph."""
    if dtype is None:
        dtype = torch.bool if isinstance(number, torch.SymBool) else torch.int64 if isinstance(number, torch.SymInt) else torch.get_default_dtype()
    return torch.scalar_tensor(number, dtype=dtype, device=device)


def state_followed(
    buffers: dict[str, torch.Tensor], traced_buffers: dict[str, torch.Tensor],
    states: dict[str, dict[str, Any]], traced_states: dict[str, dict[str, torch.Tensor]],
    outside: list[tuple[str, torch.Tensor, torch.Tensor]] = (),
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The model's buffers, the optimizer's state tensors and the tensors outside the model
    the step reads (`outside`: name, traced, real), as KnownValues takes them: the name a
    message shows, the traced tensor and the real one. Those of at most
    _MOST_STATE_FOLLOWED elements are followed: a flag, a counter, an optimizer's step count
    (RAdam's `if rho_t > 5.0:` on it), an averaged model's count (`AveragedModel`'s
    `n_averaged == 0`, which copies the weights at its first update and averages after)."""
    followed = [(f"model.{n}", traced_buffers[n], buffers[n]) for n in buffers] + list(outside)
    for param, state in states.items():
        followed += [
            (f"the optimizer's {key!r} of {param}", traced_states[param][key], value)
            for key, value in state.items() if isinstance(value, torch.Tensor) and isinstance(traced_states[param].get(key), torch.Tensor)
        ]
    return followed


class _Drew(Exception):
    """A real call drew from a generator: its values are not known (and the draw is undone)."""


def _generators() -> list[torch.Generator]:
    # The generators themselves: the step's trace refuses torch.set_rng_state (traced_rng).
    return [torch.default_generator, *(torch.cuda.default_generators if torch.cuda.is_initialized() else ())]


def _real_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`func` on real tensors, outside the trace's modes; `_Drew` where it drew random numbers
    (an op the names in _UNKNOWN miss: a distribution's sampler), with the generators put back."""
    generators = _generators()
    before = [g.get_state() for g in generators]
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        out = func(*args, **kwargs)
    if any(not torch.equal(g.get_state(), state) for g, state in zip(generators, before)):
        for g, state in zip(generators, before):
            g.set_state(state)
        raise _Drew(getattr(func, "__name__", str(func)))
    return out


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _masked(index: Any) -> bool:
    """Whether an index holds a boolean mask (a size from values; other indexing is not)."""
    return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(index))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class KnownValues(TorchFunctionMode):
    """While the step is traced: the real values beside the fake tensors whose values are
    known (the batch's, the constants the step makes), the sizes the batch's make fixed and
    checked, and the constants' results taken as they are (module docstring).
    `batch`: the batch's fake tensors and their real ones. `where_now`: the user's line calling now."""

    def __init__(
        self, batch: list[tuple[torch.Tensor, torch.Tensor]], where_now: Callable[[], str], checks: Any = None,
        state: list[tuple[str, torch.Tensor, torch.Tensor]] = (), settings: Callable[[], dict[str, Any]] = dict,
    ):
        super().__init__()
        self.numbers: dict[Any, Any] = {}  # symbol of a number read from the batch's values (`.item()`) -> the number
        self.real = WeakTensorKeyDictionary()  # fake tensor -> the real tensor it stands for
        self.from_batch = WeakTensorKeyDictionary()  # fake tensor -> True: its value comes from the batch's
        # fake tensor -> the names of the model's buffers its value comes from (a flag, a counter): followed on copies
        self.from_state = WeakTensorKeyDictionary()
        self.number_state: dict[Any, frozenset[str]] = {}  # symbol of a number read from those -> their names
        for fake, real in batch:
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):  # not a float of the batch
                self.real[fake], self.from_batch[fake] = real, True
        for name, fake, real in state:
            if real.numel() <= _MOST_STATE_FOLLOWED:  # a copy, made outside the trace: the trace writes what it writes
                self.real[fake], self.from_state[fake] = _real_call(lambda t: t.detach().clone(), (real,), {}), frozenset({name})
        self._batch_storages = {real.untyped_storage().data_ptr() for fake, real in batch if isinstance(real, torch.Tensor)}
        self.where_now = where_now
        # The optimizer's settings read as graph inputs, by their symbols, with their values: with the
        # state they decide a branch (RAdam's `rho_t > 5.0` of its step count and beta2), checked as it is.
        self._settings = settings
        if checks is not None:  # a branch that goes on either way, on a value the batch or the state decides, takes its side
            checks.known, checks.state_of, checks.where_now = self.truth, self.state_of, where_now
        self._value_shaped: dict[Any, Callable[[tuple, dict], Any]] = {
            torch.nonzero: self._nonzero, torch.Tensor.nonzero: self._nonzero,
            torch.argwhere: self._argwhere, torch.Tensor.argwhere: self._argwhere,
            torch.Tensor.__getitem__: self._getitem,
            torch.unique_consecutive: self._unique_consecutive, torch.Tensor.unique_consecutive: self._unique_consecutive,
            torch.unique: self._unique, torch.Tensor.unique: self._unique,
            torch.masked_select: None, torch.Tensor.masked_select: None, torch.repeat_interleave: None,
            torch.Tensor.repeat_interleave: None, torch.bincount: self._bincount, torch.Tensor.bincount: self._bincount,
        }  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - TorchFunctionMode's signature
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _TO_PYTHON and len(args) == 1 and self._constant(args[0]):
            return _real_call(func, (self.real[args[0]],), kwargs)
        if name in _TO_PYTHON and len(args) == 1 and self._followed_number(args[0]):
            out = func(*args, **kwargs)
            if isinstance(out, _SYMBOLIC):
                self._read_number(out.node.expr, _real_call(func, (self.real[args[0]],), kwargs), self._state_only(args[0]))
            return out
        if name == "__iter__" and len(args) == 1 and self._followed(args[0]):  # its rows, followed
            return iter(self.__torch_function__(torch.Tensor.unbind, types, (args[0], 0)))
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], _SYMBOLIC) and set(kwargs) <= {"dtype", "device"}:
            return _number_tensor(args[0], **kwargs)
        out = NotImplemented
        if func in self._value_shaped and (func is not torch.Tensor.__getitem__ or _masked(args[1])):
            tensors = _tensors((args, kwargs))
            if tensors and all(self._constant(t) for t in tensors):
                out = self._as_constant(func, args, kwargs)
            elif self._value_shaped[func] is not None:
                out = self._value_shaped[func](args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
            self._follow(func, args, kwargs, out)
        return out

    def _followed_number(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.real and t.numel() == 1

    def _read_number(self, expr: Any, real: Any, state: frozenset[str] | None) -> None:
        """The symbol the trace gave a number read from the batch's or the state's values, with
        the number: the symbol itself, or for a bool, `Eq(u, 1)` of an unbacked int; and the
        names of the buffers it comes from, where it comes from those alone (`state`)."""
        if expr.is_Symbol:
            symbol, self.numbers[expr] = expr, real
        elif isinstance(real, bool) and len(expr.free_symbols) == 1 and expr == sympy.Eq(next(iter(expr.free_symbols)), 1):
            symbol = next(iter(expr.free_symbols))
            self.numbers[symbol] = int(real)
        else:
            return
        if state:
            self.number_state[symbol] = state

    def _state_only(self, t: torch.Tensor) -> frozenset[str] | None:
        """The names of the model's buffers `t`'s value comes from, where it comes from nothing else known."""
        return self.from_state.get(t) if t not in self.from_batch else None

    def state_of(self, value: Any) -> tuple[str, ...] | None:
        """The model's buffers whose values alone decide `value` (a one-element tensor, or a
        condition on numbers read from them), by name; None where anything else does."""
        if isinstance(value, torch.Tensor):
            state = self._state_only(value) if self._followed_number(value) else None
        elif isinstance(value, _SYMBOLIC) and value.node.expr.free_symbols:
            settings = self._settings()
            found = [self.number_state.get(s) for s in value.node.expr.free_symbols if str(s) not in settings]
            state = frozenset().union(*found) if found and all(found) else None
        else:
            state = None
        return tuple(sorted(state)) if state else None

    def truth(self, value: Any) -> bool | None:
        """The truth the batch's values give `value` (a one-element tensor, or a condition on
        numbers read from them), or None where they do not decide it."""
        if isinstance(value, torch.Tensor):
            return bool(_real_call(torch.Tensor.__bool__, (self.real[value],), {})) if self._followed_number(value) else None
        if isinstance(value, _SYMBOLIC):
            expr, settings = value.node.expr, self._settings()
            numbers = {**{s: settings[str(s)] for s in expr.free_symbols if str(s) in settings}, **self.numbers}
            if expr.free_symbols and all(s in numbers for s in expr.free_symbols):
                decided = expr.xreplace({s: sympy.sympify(int(v) if isinstance(v, bool) else v) for s, v in numbers.items() if s in expr.free_symbols})
                return bool(decided) if decided.is_Boolean or decided.is_Number else None
        return None

    def _constant(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.real and t not in self.from_batch and t not in self.from_state

    def _as_constant(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` on constants: its real result, made a constant of the graph."""
        real = self._on_reals(func, args, kwargs)
        if any(r.numel() > _MOST_FOLLOWED for r in _tensors(real)):
            return NotImplemented
        out = pytree.tree_map_only(torch.Tensor, lambda r: torch.tensor(r.tolist(), dtype=r.dtype, device=r.device), real)
        for fake, r in zip(_tensors(out), _tensors(real)):
            self.real[fake] = r
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Map `out`'s tensors to their real values where every tensor `func` read is known:
        the batch's (then `out`'s are too), or none and only plain Python numbers (a factory)."""
        name = getattr(func, "__name__", "")
        if _IN_PLACE.match(name) or "out" in kwargs:
            self._write(func, args, kwargs, _tensors(kwargs["out"]) if "out" in kwargs else _tensors(args[:1]))
            return
        outs = _tensors(out)
        if not outs:  # most calls while tracing: an attribute, a size
            return
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if _UNKNOWN.search(name) or any(isinstance(x, _SYMBOLIC) for x in leaves) or any(t.numel() > _MOST_FOLLOWED for t in outs):
            return
        if not all(t in self.real for t in tensors) or not (tensors or name in _FACTORIES):
            return
        try:
            real = self._on_reals(func, args, kwargs)
        except Exception:  # noqa: BLE001 - an op the real tensors cannot take here is simply not followed
            return
        from_batch = any(t in self.from_batch for t in tensors)
        state = frozenset().union(*(self.from_state.get(t, frozenset()) for t in tensors))
        for fake, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(real)):
            if isinstance(fake, torch.Tensor) and isinstance(r, torch.Tensor) and tuple(fake.shape) == tuple(r.shape):
                self.real[fake] = r
                if from_batch:
                    self.from_batch[fake] = True
                if state:
                    self.from_state[fake] = state

    def _on_reals(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` on the real tensors of `args` and `kwargs`' fake ones."""
        return _real_call(func, *pytree.tree_map_only(torch.Tensor, self.real.__getitem__, (args, kwargs)))

    def _write(self, func: Any, args: tuple, kwargs: dict, written: list[torch.Tensor]) -> None:
        """A write in place: made on the real tensors too where it reads only known ones and
        writes none of the batch's own (the user's); otherwise what shares the written
        storage is no longer followed."""
        known = all(t in self.real for t in _tensors((args, kwargs))) and not _UNKNOWN.search(getattr(func, "__name__", ""))
        if known and not any(self.real[w].untyped_storage().data_ptr() in self._batch_storages for w in written if w in self.real):
            try:
                self._on_reals(func, args, kwargs)
                return
            except Exception:  # noqa: BLE001 - not made on the reals: they no longer follow
                pass
        self._drop_sharing(written)

    def _drop_sharing(self, written: list[torch.Tensor]) -> None:
        storages = {self.real[t].untyped_storage().data_ptr() for t in written if t in self.real}
        for fake in [f for f, r in self.real.items() if r.untyped_storage().data_ptr() in storages]:
            del self.real[fake]

    def _fixed_nonzero(self, x: torch.Tensor) -> torch.Tensor:
        """nonzero_static of `x` (the batch's, followed) at its real count, checked at every call."""
        real = self.real[x]
        count = int(_real_call(torch.count_nonzero, (real,), {}))
        size_check(torch.count_nonzero(x), count, self.where_now(), False)
        out = torch.nonzero_static(x, size=count)
        self.real[out], self.from_batch[out] = _real_call(torch.nonzero, (real,), {}), True
        return out

    def _followed(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x in self.real and x.dim() > 0

    def _nonzero(self, args: tuple, kwargs: dict) -> Any:
        if len(args) != 1 or set(kwargs) - {"as_tuple"} or not self._followed(args[0]):
            return NotImplemented
        out = self._fixed_nonzero(args[0])
        return tuple(out.unbind(1)) if kwargs.get("as_tuple") else out

    def _argwhere(self, args: tuple, kwargs: dict) -> Any:
        if len(args) != 1 or kwargs or not self._followed(args[0]):
            return NotImplemented
        return self._fixed_nonzero(args[0])

    def _getitem(self, args: tuple, kwargs: dict) -> Any:
        """`t[mask]` with a followed boolean mask as `t[i0, i1, ...]`, its nonzero's columns:
        how torch itself indexes by a mask, the same elements in the same order."""
        t, index = args
        parts = list(index) if isinstance(index, tuple) else [index]
        masks = [i for i, p in enumerate(parts) if self._followed(p) and p.dtype == torch.bool]
        if kwargs or not masks:
            return NotImplemented
        for i in reversed(masks):
            parts[i : i + 1] = list(self._fixed_nonzero(parts[i]).unbind(1))
        new_index = tuple(parts)
        out = t[new_index]
        self._follow(torch.Tensor.__getitem__, (t, new_index), {}, out)
        return out

    def _bincount(self, args: tuple, kwargs: dict) -> Any:
        """bincount of integers at a fixed number of bins, checked at every call: the batch's
        own (followed) at what their real values give; others (a metric's classes, from the
        model's predictions) at `minlength`, where every value is below it, as a class index
        below the number of classes is."""
        names = ("input", "weights", "minlength")
        bound = {**dict(zip(names, args)), **kwargs}
        x, weights, minlength = bound.get("input"), bound.get("weights"), bound.get("minlength", 0)
        if set(bound) - set(names) or not isinstance(x, torch.Tensor) or x.dim() != 1 or not _integral(x) or not isinstance(minlength, int):
            return NotImplemented
        if isinstance(weights, torch.Tensor) and weights.requires_grad:  # eager's result has no gradient either: left to fail as it does
            return NotImplemented
        if x in self.real:
            real = _real_call(torch.bincount, (self.real[x],), {"minlength": minlength})
            size, advice = real.numel(), ""
        elif minlength > 0:
            real, size = None, minlength
            advice = (
                "The values it counts come from the step (the model's predictions), not from the batch alone, so remat "
                f"fixes its bins at bincount's minlength, {minlength}, and checks at every call that no value reaches it: "
                f"a value of {minlength} or more did (a class index at or above the number of classes; a metric's "
                "num_classes too small). Keep the values below minlength, or raise it."
            )
        else:
            return NotImplemented
        # The bins the values need: one past the largest, at least `minlength` (an empty `x` needs only those).
        needed = torch.cat([x, x.new_full((1,), minlength - 1)]).amax() + 1
        size_check(needed, size, self.where_now(), False, advice)
        out = bincount_fixed(x, weights, size)
        if real is not None and weights is None:
            self.real[out], self.from_batch[out] = real, True
        return out

    def _unique_consecutive(self, args: tuple, kwargs: dict) -> Any:
        return self._fixed_unique(args, kwargs, consecutive=True)

    def _unique(self, args: tuple, kwargs: dict) -> Any:
        if kwargs.get("sorted", True) is not True:
            return NotImplemented
        return self._fixed_unique(args, {k: v for k, v in kwargs.items() if k != "sorted"}, consecutive=False)

    def _fixed_unique(self, args: tuple, kwargs: dict, consecutive: bool) -> Any:
        """unique(_consecutive) of the batch's integers, flattened, values only, at their real size."""
        plain = all(not v for k, v in kwargs.items() if k in ("return_inverse", "return_counts")) and kwargs.get("dim") is None
        if len(args) != 1 or not plain or not self._followed(args[0]) or not _integral(args[0]):
            return NotImplemented
        x = args[0]
        real = _real_call(torch.unique_consecutive if consecutive else torch.unique, (self.real[x],), {})
        flat = x.reshape(-1) if consecutive else x.reshape(-1).sort().values
        count = (flat[1:] != flat[:-1]).sum() + 1 if flat.numel() else flat.new_zeros((), dtype=torch.long)
        size_check(count, real.numel(), self.where_now(), False)
        out = unique_fixed(x, real.numel(), consecutive)
        self.real[out], self.from_batch[out] = real, True
        return out


# Factories whose values their arguments tell (not `empty`, nor a random one).
_FACTORIES = frozenset({"tensor", "as_tensor", "arange", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "linspace", "eye", "scalar_tensor"})


def checked_first(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with each size check, and the ops it reads, run first, before anything changes:
    they read the batch through ops that write nothing and draw nothing. A check whose ops
    are not all such stays where it is, and says so when it fails."""
    graph = gm.graph
    checks = [n for n in graph.nodes if n.target is SIZE_CHECK_OP]
    if not checks:
        return gm
    after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for check in checks:
        chain = op_facts.ops_read(check)
        if not all(op_facts.is_pure(n) or op_facts.is_getitem(n) for n in chain):
            continue
        after = op_facts.moved_after(after, chain, check)
        check.args = (*check.args[:3], True, *check.args[4:])
    graph.lint()
    gm.recompile()
    return gm
