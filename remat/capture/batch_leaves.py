"""The batch's leaves as the graph takes them. The batch is a pytree (a UserDict looked
into: `flatten_batch`); its tensors are graph inputs, and so are its floats, as 0-dim
float64 inputs traced as symbolic floats (`batch_value`): a use that needs the value fixed
is refused. Its ints (within int64) are graph inputs too, as 0-dim int64 ones. Its other
plain values (names and paths as strings, a flag, None) are not inputs. Each str, bytes
and int is traced as a stand-in that marks itself read at any use (`_StandIn`). An int the
step computes with (`loss / batch["ntokens"]`, returned, summed, compared) is traced again
as a symbolic int, read at every call as a float is; a comparison of it alone (`max(n, 1)`)
is decided on the example's side, which the key holds (`BatchValues.decided`). One it uses
otherwise (a size, a format, a key), or that its symbol cannot go through, and every other
plain value the step reads, is traced again as its value, the graph keyed by it
(`BatchValues.read`: a new value compiles a new graph); one it never reads takes any value. None and bools are
always traced as their value: a test of identity (`x is None`, `flag is True`) calls
nothing that could mark a stand-in read."""

from __future__ import annotations

import warnings
from collections import UserDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat.capture.optim import hyperparams
from remat.capture.state.slots import holds
from remat.capture.state.read_numbers import Condition, TextOfNumber
from remat.capture.trace_checks import users_stacklevel, where_in_users_code
from remat.errors import CaptureError

STAND_IN_TYPES = (str, bytes, int)  # traced as stand-ins: read or not, the trace tells
VALUE_TYPES = (bool, type(None))  # traced as their value, and keyed by it
_INT64 = range(-(2**63), 2**63)


def flatten_batch(batch: Any) -> tuple[list[Any], Any]:
    """The batch's leaves and structure (pytree), with UserDicts looked into: transformers'
    BatchEncoding, what its tokenizers and data collators return, is one. Each such kind
    is registered with pytree on first sight, its items its leaves; the step gets one of
    the same kind back, made from a dict of its items."""
    leaves, spec = pytree.tree_flatten(batch)
    new = {type(leaf) for leaf in leaves if isinstance(leaf, UserDict)}
    if not new:
        return leaves, spec
    for kind in new:
        pytree.register_pytree_node(
            kind,
            lambda d: (list(d.data.values()), tuple(d.data)),
            lambda values, keys, kind=kind: kind(dict(zip(keys, values))),
            flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.data.items()], tuple(d.data)),
            serialized_type_name=f"{kind.__module__}.{kind.__qualname__}",
        )
    return flatten_batch(batch)


def is_plain_value(leaf: Any) -> bool:
    """A leaf that is not a graph input: a str, bytes, int, bool or None."""
    return type(leaf) in STAND_IN_TYPES or type(leaf) in VALUE_TYPES


def is_graph_leaf(leaf: Any) -> bool:
    """A leaf the graph takes as an input: a tensor, a float, or an int within int64."""
    return not is_plain_value(leaf) or is_counted(leaf)


def is_counted(leaf: Any) -> bool:
    """An int the graph takes as an input (within int64): symbolic where the step computes with it."""
    return type(leaf) is int and leaf in _INT64


def graph_leaves(leaves: list[Any]) -> list[Any]:
    """The leaves the graph takes as inputs: tensors, floats and ints."""
    return [leaf for leaf in leaves if is_graph_leaf(leaf)]


def check_batch(batch: Any) -> tuple[list[Any], Any]:
    """The batch's leaves and structure: tensors, floats (a loss weight, a mixup
    coefficient drawn in the loop), each read at every call (`batch_value`), and plain
    values (`is_plain_value`)."""
    leaves, spec = flatten_batch(batch)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise CaptureError(
            f"the batch ({type(batch).__name__}) holds no tensors remat can find: pass a tensor, or a tuple, list or "
            "dict of them (a dataclass: dataclasses.asdict(batch))"
        )
    for name, leaf in zip(batch_leaf_names(batch), leaves):
        if not isinstance(leaf, (torch.Tensor, float)) and not is_plain_value(leaf):
            raise CaptureError(
                f"the batch must hold tensors, floats and plain values (str, int, bool, None) in tuples, lists and dicts; "
                f"{name} is a {type(leaf).__name__}. Convert it to a tensor (torch.as_tensor for a numpy array), or "
                "leave it out of the batch given to the step."
            )
    return leaves, spec


def batch_value(leaf: Any) -> torch.Tensor:
    """A graph leaf as its graph input: a float is a 0-dim float64 tensor, read back as a
    Python float inside the trace (a symbolic float, as a hyperparameter is), so the step's
    arithmetic on it is eager's, on the same double, and a new value needs no new graph; an
    int a 0-dim int64 one, the same way."""
    if isinstance(leaf, float):
        return torch.scalar_tensor(leaf, dtype=torch.float64)
    return torch.scalar_tensor(leaf, dtype=torch.int64) if type(leaf) is int else leaf


def graph_values(leaves: list[Any]) -> list[torch.Tensor]:
    """The graph inputs the batch's leaves give."""
    return [batch_value(leaf) for leaf in graph_leaves(leaves)]


def batch_leaf_names(batch: Any) -> list[str]:
    return [f"batch{pytree.keystr(p)}" for p, _ in pytree.tree_flatten_with_path(batch)[0]]


def set_by_step(batch: Any, leaves: list[Any], spec: Any) -> list[str]:
    """The places of the batch, by name (a dict's keys, a list's items), that the step set,
    added or deleted: `batch` as the step left it, `leaves` and `spec` as it was given."""
    given = dict(zip(batch_leaf_names(pytree.tree_unflatten(leaves, spec)), leaves))
    now = dict(zip(batch_leaf_names(batch), pytree.tree_leaves(batch)))
    return [name for name in {**given, **now} if given.get(name, _ABSENT) is not now.get(name, _ABSENT)]


_ABSENT = object()


def warn_batch_set(names: list[str]) -> None:
    """Say, once a capture's traces are done, which places of the batch the step set."""
    if names:
        warnings.warn(
            f"remat: train_step sets {', '.join(names[:4])}{' and more' if len(names) > 4 else ''} in the batch it is given. "
            "The step computes with what it sets, as eager's does, but leaves your batch as it was (the graph reads the "
            "batch and writes nothing into it): a loop that reads those after the step should take them from what the "
            "step returns.",
            stacklevel=users_stacklevel(),
        )


def read_key(leaves: list[Any], read: frozenset[int]) -> tuple[tuple[int, Any], ...]:
    """What of the batch's plain values a graph that reads those at positions `read` holds
    (and every int outside int64, which no graph input can take)."""
    return tuple(
        (i, leaf) for i, leaf in enumerate(leaves)
        if is_plain_value(leaf) and (i in read or (type(leaf) is int and not is_counted(leaf)))
    )  # fmt: skip


class _StandIn:
    """A plain value of the batch in the trace: `isinstance` sees its value's type, and
    any other use (a method, an operator, str(), hash(), a comparison) marks it read and
    raises, so that the trace is made again with the value itself."""

    __slots__ = ("_kind", "_position", "_marks")

    def __init__(self, kind: type, position: int, marks: BatchValues) -> None:
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_position", position)
        object.__setattr__(self, "_marks", marks)  # where its use is marked (BatchValues.touched, .computed)

    def __getattribute__(self, attr: str) -> Any:
        if attr == "__class__":  # isinstance's second look: the value's type
            return object.__getattribute__(self, "_kind")
        _touch(self)


class BatchValueRead(AttributeError):
    """Raised by a stand-in at its first use; the trace is made again (an AttributeError so
    that getattr(x, name, default) and hasattr carry on to the next trace as they would)."""


def _touch(stand_in: _StandIn, *_: Any, **__: Any) -> Any:
    object.__getattribute__(stand_in, "_marks").touched.add(object.__getattribute__(stand_in, "_position"))
    raise BatchValueRead("a value of the batch read while tracing: traced again with its value")


def _compute(stand_in: _StandIn, *_: Any, **__: Any) -> Any:
    """A use a symbolic int can take: an int is traced again as one, anything else as its value."""
    object.__getattribute__(stand_in, "_marks").computed.add(object.__getattribute__(stand_in, "_position"))
    raise BatchValueRead("a value of the batch computed with while tracing: traced again as a symbol")


# The uses a stand-in marks: none that an abstract base class tells types apart by
# (`__call__`, `__fspath__`, `__enter__`: callable() and isinstance(x, os.PathLike) must say
# what they say of the value), so that a step taking another branch on a stand-in takes it
# on the value too; an int's has no items (isinstance(x, Iterable) is False for an int).
# A use left out fails the trace, which then holds every plain value as itself. Arithmetic,
# comparisons and truth (`_COMPUTED`) a symbolic int can take (a comparison as a side the
# key holds); the rest (a format, an index, a hash) needs the value.
_USES = """setattr delattr hash str repr format bytes int float index complex round trunc floor ceil abs reduce
reduce_ex copy deepcopy dir sizeof""".split()
_COMPUTED = """eq ne lt le gt ge bool neg pos invert add radd sub rsub mul rmul matmul rmatmul truediv rtruediv floordiv
rfloordiv mod rmod divmod rdivmod pow rpow and rand or ror xor rxor lshift rlshift rshift rrshift""".split()
for _use in _USES:
    setattr(_StandIn, f"__{_use}__", _touch)
for _use in _COMPUTED:
    setattr(_StandIn, f"__{_use}__", _compute)


class _TextStandIn(_StandIn):
    """A str's or bytes' stand-in: a sequence, as they are."""

    __slots__ = ()


for _use in "len iter reversed contains getitem".split():
    setattr(_TextStandIn, f"__{_use}__", _touch)


@dataclass
class BatchValues:
    """The batch's leaves that are not tensors, by position: its floats (symbolic floats in
    the trace, graph inputs read at every call, but those `fixed`, only to tell why a trace
    failed: the example's values), and its plain values (`plain`: stand-ins, but those
    `read`, traced as their values, and the ints `symbolic`, traced as symbolic ints)."""

    names: dict[int, str]
    plain: dict[int, Any]
    read: set[int]
    counted: dict[int, str] = field(default_factory=dict)  # the ints that are graph inputs, by name
    symbolic: set[int] = field(default_factory=set)
    fixed: frozenset[int] = frozenset()
    touched: set[int] = field(default_factory=set)  # stand-ins used in the trace being made
    computed: set[int] = field(default_factory=set)  # of those, the ones computed with (arithmetic)
    symbols: set[str] = field(default_factory=set)  # the symbols the trace being made has for them
    conditions: dict[int, list[Condition]] = field(default_factory=dict)  # a symbolic int's comparisons: the key holds their sides

    @classmethod
    def of(cls, batch: Any, leaves: list[Any], read: frozenset[int] = frozenset()) -> BatchValues:
        names = batch_leaf_names(batch)
        plain = {i: leaf for i, leaf in enumerate(leaves) if is_plain_value(leaf)}
        return cls(
            {i: names[i] for i, leaf in enumerate(leaves) if isinstance(leaf, float)},
            plain,
            {i for i, leaf in plain.items() if type(leaf) in VALUE_TYPES or i in read or (type(leaf) is int and not is_counted(leaf))},
            {i: names[i] for i, leaf in plain.items() if is_counted(leaf)},
        )

    def traced(self, inputs: list[Any], example: list[Any], symbols: dict[str, str]) -> list[Any]:
        """The batch's traced leaves from the graph's batch inputs: each float a symbolic
        float (its name in `symbols`), or the example's value where fixed; each plain value
        a stand-in, or itself where read, or for an int a symbolic int where symbolic."""
        self.touched.clear()
        self.computed.clear()
        self.symbols.clear()
        it = iter(inputs)
        leaves: list[Any] = []
        for i in range(len(example)):
            if i not in self.plain:
                leaves.append(next(it))
                continue
            value = self.plain[i]
            held = next(it) if i in self.counted else None
            if i in self.read:
                leaves.append(value)
            elif i in self.symbolic:
                leaves.append(symbol := self._symbol(hyperparams.traced_number(held, self.counted[i], None, symbols)))
                for condition in self.conditions.get(i, ()):
                    condition.told(symbol, value)
            else:
                leaves.append((_TextStandIn if type(value) in (str, bytes) else _StandIn)(type(value), i, self))
        for i, name in self.names.items():
            leaves[i] = example[i] if i in self.fixed else self._symbol(hyperparams.traced_number(leaves[i], name, None, symbols))
        return leaves

    def _symbol(self, value: Any) -> Any:
        self.symbols.add(str(value.node.expr))
        return value

    def newly_read(self, failed: bool = False) -> bool:
        """Whether the trace just made used plain values it had as stand-ins: an int it
        computed with is traced as a symbolic int from now on, any other as its value.
        `failed`: the trace failed otherwise, where a symbolic int may have failed it (a
        symbol of its own made from one) or a stand-in untouched (torch's C code refuses it
        as not an int): every symbolic int is traced as its value from now on, or if there
        were none, every plain value, if any was not."""
        counted = (self.computed & set(self.counted)) - self.read - self.symbolic
        new = (self.touched | self.computed) - self.read - self.symbolic - counted
        if not new and not counted and failed:  # the symbolic ints first: a slice by one makes symbols of its own
            new = set(self.symbolic) or set(self.plain) - self.read
        self.symbolic = (self.symbolic | counted) - new
        self.read |= new
        return bool(new or counted)

    def decided(self, branched: list[str], cond: Any, symbols: dict[str, str]) -> bool:
        """After a trace failed on a branch: where it was on one symbolic int alone (`max(n,
        1)`, `if n > 0`), the trace is told the side the example is on, the key holds that
        side from now on (a graph per side, not per value: `sides`); where it cannot be told
        (text made of it, another number in the condition), the symbolic ints it branched on
        are traced as their values. True if the trace is worth making again."""
        ints = [i for i in self.symbolic if self.counted[i] in branched]
        if len(ints) == 1 and len(branched) == 1:
            symbol = [s for s in getattr(cond, "free_symbols", ()) if symbols.get(str(s)) == branched[0]]
            learned = Condition.learned(cond, symbol[0], self.plain[ints[0]]) if symbol else None
            if learned is not None and learned not in self.conditions.get(ints[0], []):
                self.conditions.setdefault(ints[0], []).append(learned)
                return True
        return self.as_values(branched)

    def as_values(self, names: set[str] | list[str]) -> bool:
        """The symbolic ints among `names` (those a trace branched on, or sized a tensor by)
        are traced as their values from now on. True if there were any (trace again)."""
        new = {i for i in self.symbolic if self.counted[i] in names}
        self.symbolic -= new
        self.read |= new
        for i in new:
            self.conditions.pop(i, None)
        return bool(new)

    def sides(self) -> dict[int, tuple[Condition, ...]]:
        """The comparisons of each symbolic int the graph assumes a side of, by position."""
        return {i: tuple(conds) for i, conds in self.conditions.items() if i in self.symbolic and conds}

    def escaped(self, values: Callable[[], list[Any]]) -> None:
        """Mark used the stand-ins among `values` (what the step returned, and the user's
        state after it): the graph gives them back or leaves them there, so it holds the
        values (an int as a symbolic int, given back as the number each call has)."""
        if set(self.plain) - self.read - self.symbolic:
            for value in values():
                holds(value, self._seen)

    def _seen(self, value: Any) -> bool:
        if isinstance(value, _StandIn):
            position = object.__getattribute__(value, "_position")
            (self.computed if position in self.counted else self.touched).add(position)
        return False  # on through the rest

    def refuse_branch(self, branched: list[str], e: BaseException) -> None:
        on = [n for n in branched if n in self.names.values()]
        if on and isinstance(e, TextOfNumber):
            raise CaptureError(
                f"train_step formats {on[0]}, a float of the batch, into text{where_in_users_code(e)}: the graph reads it "
                "at every call, and the step's Python code runs once, at capture, where its value is not known. Pass it "
                "to print or logging as an argument (print('w', w)), which remat makes again after each step with its "
                "value, or format it outside train_step."
            ) from e
        if on:
            raise CaptureError(
                f"train_step needs {on[0]}, a float of the batch, as a fixed value{where_in_users_code(e)} (a branch on "
                "it, torch.tensor(x), a size): the graph reads it at every call, so one graph cannot hold that use. Use "
                "it in arithmetic on tensors (x * w), pass it as a tensor, or decide outside train_step and pass what "
                "was decided."
            ) from e

    def refuse_use(self, trace: Callable[[], Any], e: BaseException) -> None:
        """After a trace failed otherwise: if it succeeds with a float fixed, that float was
        used where a number that changes cannot go (numpy's functions on it, a rate)."""
        alone = [{i} for i in self.names]
        for fixed in alone + [set(self.names)] if len(alone) > 1 else alone:  # each alone, then all together
            self.fixed = frozenset(fixed)
            try:
                trace()
            except Exception:  # noqa: BLE001 - not this one: the next, or the first failure is explained
                continue
            finally:
                self.fixed = frozenset()
            names = ", ".join(self.names[i] for i in sorted(fixed))
            raise CaptureError(
                f"train_step uses {names} (floats of the batch) where a number that changes at every call cannot go "
                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}){where_in_users_code(e)}: "
                "the graph reads the batch's floats at every call. Compute that use outside train_step and pass its "
                "result in the batch, or compute it with torch's ops on the tensors."
            ) from e
