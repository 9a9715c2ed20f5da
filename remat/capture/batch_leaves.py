"""The batch's leaves as the graph takes them. The batch is a pytree (a UserDict looked
into: `flatten_batch`); its tensors are graph inputs, and so are its floats, as 0-dim
float64 inputs traced as symbolic floats (`batch_value`): a use that needs the value fixed
is refused. Its other plain values (names and paths as strings, an int id or count, a
flag, None) are not inputs: each str, bytes and int is traced as a stand-in that marks
itself read at any use (`_StandIn`), and one the step reads is traced again as its value,
the graph keyed by it (`BatchValues.read`: a new value compiles a new graph); one it never
reads takes any value. None and bools are always traced as their value: a test of
identity (`x is None`, `flag is True`) calls nothing that could mark a stand-in read."""

from __future__ import annotations

from collections import UserDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat.capture.optim import hyperparams
from remat.capture.state.python_state import holds
from remat.capture.trace_checks import where_in_users_code
from remat.errors import CaptureError

STAND_IN_TYPES = (str, bytes, int)  # traced as stand-ins: read or not, the trace tells
VALUE_TYPES = (bool, type(None))  # traced as their value, and keyed by it


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


def graph_leaves(leaves: list[Any]) -> list[Any]:
    """The leaves the graph takes as inputs: tensors and floats."""
    return [leaf for leaf in leaves if not is_plain_value(leaf)]


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
    arithmetic on it is eager's, on the same double, and a new value needs no new graph."""
    return torch.scalar_tensor(leaf, dtype=torch.float64) if isinstance(leaf, float) else leaf


def graph_values(leaves: list[Any]) -> list[torch.Tensor]:
    """The graph inputs the batch's leaves give."""
    return [batch_value(leaf) for leaf in graph_leaves(leaves)]


def batch_leaf_names(batch: Any) -> list[str]:
    return [f"batch{pytree.keystr(p)}" for p, _ in pytree.tree_flatten_with_path(batch)[0]]


def read_key(leaves: list[Any], read: frozenset[int]) -> tuple[tuple[int, Any], ...]:
    """What of the batch's plain values a graph that reads those at positions `read` holds."""
    return tuple((i, leaves[i]) for i in sorted(read) if i < len(leaves) and is_plain_value(leaves[i]))


class _StandIn:
    """A plain value of the batch in the trace: `isinstance` sees its value's type, and
    any other use (a method, an operator, str(), hash(), a comparison) marks it read and
    raises, so that the trace is made again with the value itself."""

    __slots__ = ("_kind", "_position", "_touched")

    def __init__(self, kind: type, position: int, touched: set[int]) -> None:
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_position", position)
        object.__setattr__(self, "_touched", touched)

    def __getattribute__(self, attr: str) -> Any:
        if attr == "__class__":  # isinstance's second look: the value's type
            return object.__getattribute__(self, "_kind")
        _touch(self)


class BatchValueRead(AttributeError):
    """Raised by a stand-in at its first use; the trace is made again (an AttributeError so
    that getattr(x, name, default) and hasattr carry on to the next trace as they would)."""


def _touch(stand_in: _StandIn, *_: Any, **__: Any) -> Any:
    object.__getattribute__(stand_in, "_touched").add(object.__getattribute__(stand_in, "_position"))
    raise BatchValueRead("a value of the batch read while tracing: traced again with its value")


# The uses a stand-in marks: none that an abstract base class tells types apart by
# (`__call__`, `__fspath__`, `__enter__`: callable() and isinstance(x, os.PathLike) must say
# what they say of the value), so that a step taking another branch on a stand-in takes it
# on the value too; an int's has no items (isinstance(x, Iterable) is False for an int).
# A use left out fails the trace, which then holds every plain value as itself.
_USES = """setattr delattr eq ne lt le gt ge hash bool str repr format bytes int float index complex round trunc
floor ceil abs neg pos invert add radd sub rsub mul rmul matmul rmatmul truediv rtruediv floordiv rfloordiv mod
rmod divmod rdivmod pow rpow and rand or ror xor rxor lshift rlshift rshift rrshift reduce reduce_ex copy
deepcopy dir sizeof""".split()
for _use in _USES:
    setattr(_StandIn, f"__{_use}__", _touch)


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
    `read`, traced as their values)."""

    names: dict[int, str]
    plain: dict[int, Any]
    read: set[int]
    fixed: frozenset[int] = frozenset()
    touched: set[int] = field(default_factory=set)  # stand-ins used in the trace being made

    @classmethod
    def of(cls, batch: Any, leaves: list[Any], read: frozenset[int] = frozenset()) -> BatchValues:
        names = batch_leaf_names(batch)
        plain = {i: leaf for i, leaf in enumerate(leaves) if is_plain_value(leaf)}
        return cls(
            {i: names[i] for i, leaf in enumerate(leaves) if isinstance(leaf, float)},
            plain,
            {i for i, leaf in plain.items() if type(leaf) in VALUE_TYPES or i in read},
        )

    def traced(self, inputs: list[Any], example: list[Any], symbols: dict[str, str]) -> list[Any]:
        """The batch's traced leaves from the graph's batch inputs: each float a symbolic
        float (its name in `symbols`), or the example's value where fixed; each plain value
        a stand-in, or itself where read."""
        self.touched.clear()
        it = iter(inputs)
        leaves: list[Any] = []
        for i in range(len(example)):
            if i not in self.plain:
                leaves.append(next(it))
            else:
                kind = type(self.plain[i])
                leaves.append(self.plain[i] if i in self.read else (_TextStandIn if kind in (str, bytes) else _StandIn)(kind, i, self.touched))
        for i, name in self.names.items():
            leaves[i] = example[i] if i in self.fixed else hyperparams.traced_float(leaves[i], name, None, symbols)
        return leaves

    def newly_read(self, failed: bool = False) -> bool:
        """Whether the trace just made read plain values it had as stand-ins: they are traced
        as their values from now on. `failed`: the trace failed otherwise, where a stand-in
        may have failed it untouched (torch's C code refuses it as not an int): every plain
        value is traced as itself from now on, if any was not."""
        new = self.touched - self.read or (set(self.plain) - self.read if failed else set())
        self.read |= new
        return bool(new)

    def escaped(self, values: Callable[[], list[Any]]) -> None:
        """Mark read the stand-ins among `values` (what the step returned, and the user's
        state after it): the graph gives them back or leaves them there, so it holds the values."""
        if set(self.plain) - self.read:
            for value in values():
                holds(value, self._seen)

    def _seen(self, value: Any) -> bool:
        if isinstance(value, _StandIn):
            self.touched.add(object.__getattribute__(value, "_position"))
        return False  # on through the rest

    def refuse_branch(self, branched: list[str], e: BaseException) -> None:
        if on := [n for n in branched if n in self.names.values()]:
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
