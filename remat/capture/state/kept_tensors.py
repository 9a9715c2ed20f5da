"""Tensors the step leaves in the user's state: `self.aux_loss = ...` in a mixture-of-experts
layer's forward, `self.last_logits = logits.detach()` in a trainer, `features[name] = out`
in a forward hook.

Traced once, the place would hold a traced placeholder after capture, and nothing the
steps compute. So the tensor becomes an output of the graph, and after each run the place
is set to its value (detached: the step's autograd graph is freed by then, as eager's is).

- **A slot** (python_state's: an attribute, a global, a closure cell) left holding a
  tensor made by the trace, other than the graph input it held, or a new tuple, list or
  dict of only such tensors (an LSTM's `(h, c)` carried to the next step), is noted when
  the step's Python code ends, and put back; one holding a traced tensor beside anything
  else (a parameter, a number) is refused. A slot that held nothing before (a field the step
  creates), or no tensors where the user's code holds it (a state that starts as None),
  stays part of the step's cache key: the step is compiled again once it holds them.
- **A key of a dict** held in a slot (not a library's): while the step is traced, each
  such dict is swapped for a recording copy (one per dict, in every slot that holds it),
  which notes the keys the step sets and whether it reads anything it had not set first.
  A key set to a tensor or number the trace computed is set after each run; the dict
  itself is left out of the step's cache key where the step read nothing from it but what
  it had set (features a hook stores and the loss reads), so a step that stores features
  is not compiled again when the dict holds the last step's. The user's dict is put back;
  any other change to it (a key deleted, a plain value set) is made there, and judged as
  before (python_state).
- **A tensor's `.data`** set in the step (`param_k.data = param_k.data * m + param_q.data *
  (1 - m)`, MoCo's key encoder): make_fx would go on reading the tensor as it was, and the
  placeholder would stay as it came in. While the step is traced, `t.data = new` (seen by a
  torch function mode) rebinds `t` to `new` for the rest of the trace, as eager does; a
  graph input (a parameter, buffer or state) so set has its new value written into its
  memory at the end of the graph, where nothing reads the value it came in with any more.
  That needs the same shape, dtype, device and strides, and `new` made in the step: a
  tensor of another input would share its memory from then on (`target.data =
  online.data`), which one graph run after another cannot keep. Those are refused. A
  buffer the step rebinds (`self.num_calls = self.num_calls + 1`, an average kept as
  `self.avg = 0.9 * self.avg + ...` in a forward) is the same case: make_fx's module
  stand-in would be put back with the buffer as it came in, so its new value is written
  into its memory the same way.
- **A buffer the step makes** (`KeptBuffer`), in the model or in another module held in
  a slot (a teacher): registered in a forward where the module
  had none of that name or held None there (a rotary embedding's cos/sin cache made at
  the first call, or grown for a longer sequence), or rebound to a tensor of another
  shape. Left there, the trace's placeholder would be in the user's model; so the
  module's buffer table is put back as it was, and the tensor is a graph output,
  registered after each run (persistent or not, as the step registered it). What the
  buffer holds is in the step's key, so once it is there the step compiles again and the
  next graph reads it as one of the model's buffers, as eager's later steps do. A
  parameter the step registers or replaces is refused: the optimizer does not hold it.
- **An attribute of a parameter or buffer** (`attributes_on`): the stand-in holds the real
  tensor's attributes while the step is traced (a flag the user's optimizer reads); one the
  step leaves holding a tensor it computed (opacus' per-sample gradients, `p.grad_sample`)
  is kept on the real tensor as a slot's is, any other change refused by name.
Tensors in a list or dict nested in another container stay refused (python_state).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import proxy_tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from remat.capture import param_hooks
from remat.capture.state import user_code
from remat.capture.state.logged_numbers import record_calls
from remat.capture.trace_checks import where_in_users_code_now
from remat.errors import CaptureError
from remat.capture.state.python_state import MISSING, Slot, item_name, kept_error
from remat.capture.state.slots import TRACED_NUMBERS, TensorSignature

_MOST_KEYS = 256  # a larger dict is left as it is (watched as a value)


@dataclass(frozen=True)
class KeptTensor:
    """A slot set to the graph's next output after each run (a tensor, or a tuple, list or dict of them)."""

    slot: Slot
    keyed: bool  # it held no tensors before (nothing, or None in the user's code): what it holds stays part of the cache key
    count = 1

    def where(self) -> str:
        return f"kept in {self.slot.name}"

    def replay(self, values: list[Any]) -> None:
        self.slot.set(values[0])


@dataclass(frozen=True)
class KeptBuffer(KeptTensor):
    """A buffer the step makes (module docstring), registered on `module` after each run
    (`slot`: its entry in the module's buffer table)."""

    module: torch.nn.Module | None = None
    persistent: bool = True

    def where(self) -> str:
        return f"registered as the buffer {self.slot.name}"

    def branch(self) -> tuple[str, Any]:
        """In the step's key: whether the module holds the buffer, and its signature (TensorSignature)."""
        held = self.slot.get()
        return self.slot.name, TensorSignature.of(held) if isinstance(held, torch.Tensor) else None

    def replay(self, values: list[Any]) -> None:
        self.module.register_buffer(self.slot.key, values[0], persistent=self.persistent)


@contextlib.contextmanager
def setting(slots: Callable[[], list[tuple[Slot, Any]]], inputs: set[int]) -> Iterator[list[tuple[KeptTensor, Any]]]:
    """Around the step's Python code while it is traced: after it, each slot left holding a
    traced tensor other than what it held at the start (a graph input, `inputs` by id),
    with that tensor; each slot put back."""
    before = {slot.name: value for slot, value in slots()}
    set_: list[tuple[KeptTensor, Any]] = []
    traced = False
    mixed: list[str] = []
    try:
        yield set_
        traced = True
    finally:  # a trace that fails (one side of a value check tried) puts them back too
        now = slots()
        made = {id(value) for slot, value in now if value is not before.get(slot.name, MISSING)}
        for slot, value in now:
            held = before.get(slot.name, MISSING)
            if value is held or id(slot.owner) in made:
                continue  # a field of an object the step made (a cache made at the first call): python_state judges it
            if isinstance(slot.owner, Slot) and not isinstance(value, FakeTensor):
                continue  # a key of a dict watched key by key: a list made there is a log (first_call's defaultdict keys)
            if _computed_tensors(value, inputs):
                if traced:
                    set_.append((KeptTensor(slot, keyed=held is MISSING or not _tensors(held) and _users(slot)), value))
                slot.set(held)
            elif isinstance(value, tuple) and any(_computed(leaf, inputs) for leaf in pytree.tree_leaves(value)):
                mixed.append(slot.name)  # beside a parameter or a plain number: no graph output gives it (a list or dict is judged by python_state)
                slot.set(held)
    if mixed and traced:
        raise kept_error(mixed)


_DICT_READS = (
    "__iter__", "__len__", "__reversed__", "keys", "values", "items", "copy", "__eq__", "__ne__", "__or__", "__repr__", "__str__",
)  # fmt: skip
_DICT_CHANGES = ("__delitem__", "pop", "popitem", "clear", "update", "setdefault", "__ior__")


class _RecordingDict(dict):  # type: ignore[type-arg]
    """The user's dict while the step is traced: the keys it sets, and the first read of
    anything it had not set first (`read`, by name). Reads and writes go through to the
    user's dict, so that code holding it another way (a teacher's hook filling it) and
    the step see the same contents, as in eager."""

    def __init__(self, original: dict[Any, Any]) -> None:
        super().__init__(original)  # its own items too, for code that reads a dict in C
        self.original = original
        self.set_keys: set[Any] = set()
        self.read: str | None = None
        self.changed: str | None = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self.set_keys.add(key)
        self.original[key] = value
        super().__setitem__(key, value)

    def __getitem__(self, key: Any) -> Any:
        self._reads(key, "__getitem__")
        return self.original[key]

    def get(self, key: Any, default: Any = None) -> Any:
        self._reads(key, "get")
        return self.original.get(key, default)

    def __contains__(self, key: object) -> bool:
        self._reads(key, "__contains__")
        return key in self.original

    def _reads(self, key: Any, how: str) -> None:
        if key not in self.set_keys:
            self.read = self.read or how


record_calls(_RecordingDict, dict, _DICT_READS, _DICT_CHANGES, on=lambda d: d.original)
# A dict to torch's pytree functions (tree_map over a dict of tensors in the step), read
# through its own methods: a plain dict comes back.
pytree.register_pytree_node(_RecordingDict, lambda d: (list(d.values()), list(d.keys())), lambda values, keys: dict(zip(keys, values)))


@dataclass
class DictsSet:
    """What the traced step set in the user's dicts: the keys to set after each run, with
    their traced values, and the dicts whose contents it never read (by slot name)."""

    kept: list[tuple[KeptTensor, Any]]
    unread: frozenset[str]


@contextlib.contextmanager
def recording_dicts(slots: list[tuple[Slot, Any]], inputs: set[int]) -> Iterator[DictsSet]:
    """While the block runs, each plain dict held in a slot swapped for a recording copy
    (one per dict, in every slot that holds it); after it, the user's own put back, the
    keys the graph sets at each run as they were."""
    by_dict: dict[int, tuple[_RecordingDict, dict[Any, Any], list[Slot]]] = {}
    for slot, value in slots:
        if type(value) is dict and not slot.library and len(value) <= _MOST_KEYS:
            if id(value) not in by_dict:
                by_dict[id(value)] = (_RecordingDict(value), dict(value), [])
            by_dict[id(value)][2].append(slot)
    found = DictsSet([], frozenset())
    try:
        for recorder, _, held_in in by_dict.values():
            for slot in held_in:
                slot.set(recorder)
        yield found
    finally:
        unread = set()
        for recorder, before, held_in in by_dict.values():
            original = recorder.original
            for slot in held_in:
                if slot.get() is recorder:
                    slot.set(original)
            if recorder.changed is not None:  # left as the step made it: judged as any change to the user's state
                continue
            taken = {k: original[k] for k in recorder.set_keys if k in original and (_computed(original[k], inputs) or _computed_tensors(original[k], inputs))}
            for k in taken:  # set after each run instead; what else the step set stays, and is judged
                if k in before:
                    original[k] = before[k]
                else:
                    del original[k]
            found.kept += [(KeptTensor(Slot(item_name(held_in[0], f"[{k!r}]"), held_in[0], k), keyed=recorder.read is not None), v) for k, v in taken.items()]
            if taken and recorder.read is None:
                unread |= {slot.name for slot in held_in}
        found.unread = frozenset(unread)


def _tensors(value: Any) -> bool:
    """A tensor, or a tuple, list or dict of them: what a slot the step sets held, read by the
    graph at every call where it reads it (outside_tensors). Anything else (None before the
    first step's state, `self.state = None`) stays part of the cache key where the user's
    code holds it (`_users`): the next step's trace may branch on it."""
    leaves = pytree.tree_leaves(value) if type(value) in (tuple, list, dict) else [value]
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def _users(slot: Slot) -> bool:
    """A slot of the user's code (a global, a closure's, a field of the user's module or
    object), whose code may branch on what it held: not a library's field (torchmetrics'
    `_forward_cache`, None before its first forward, which its forward only writes)."""
    owner = slot.owner
    return isinstance(owner, (dict, types.CellType, Slot)) or user_code.user_class(type(owner))


def _computed_tensors(value: Any, inputs: set[int]) -> bool:
    """A tensor the trace computed, or a tuple, list or dict of such (an LSTM's hidden state
    `(h, c)` kept for the next step): a graph output, or several, which the graph's outputs
    put back together in the same structure (pytree)."""
    if type(value) in (tuple, list, dict) or isinstance(value, tuple) and hasattr(value, "_fields"):
        leaves = pytree.tree_leaves(value)
        return bool(leaves) and all(isinstance(leaf, FakeTensor) and id(leaf) not in inputs for leaf in leaves)
    return isinstance(value, FakeTensor) and id(value) not in inputs


def _computed(value: Any, inputs: set[int]) -> bool:
    """A tensor or number the trace computed (a placeholder of the graph's inputs is not)."""
    return isinstance(value, TRACED_NUMBERS) or (isinstance(value, FakeTensor) and id(value) not in inputs)


_DATA = torch._C.TensorBase.__dict__["data"]
_SET_DATA = _DATA.__set__


class _DataAssignments(TorchFunctionMode):
    """`t.data = new` while the step is traced, as eager does it (module docstring)."""

    def __init__(self, inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.inputs = {id(t): t for t in inputs if isinstance(t, torch.Tensor)}
        self.came_in: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # an input set: itself, and its memory as it came in
        self._memory: dict[int, StorageWeakRef] | None = None  # each input's memory as it came in, made at the first assignment

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if type(func) is type(_SET_DATA) and func == _SET_DATA:
            return self._assign(*args)
        return func(*args, **(kwargs or {}))

    def _assign(self, t: torch.Tensor, new: torch.Tensor) -> None:
        mode = proxy_tensor.get_proxy_mode()
        if mode is None:
            return _SET_DATA(t, new)
        if id(t) in self.inputs:
            self._check(t, new, "the .data of a parameter, buffer or optimizer state")
            if id(t) not in self.came_in:
                self.came_in[id(t)] = (t, _DATA.__get__(t))  # traced as a detach of the placeholder
        _SET_DATA(t, new)
        proxy_tensor.set_proxy_slot(t, mode.tracer, proxy_tensor.get_proxy_slot(new, mode.tracer))

    def _check(self, t: torch.Tensor, new: torch.Tensor, what: str) -> None:
        if self._memory is None:  # before any input is set: each one's own memory
            self._memory = memory_of(self.inputs.values())
        check_writable(t, new, what, self._memory)

    def write_back(self, rebound: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each input set, and each buffer of `rebound` (name: the buffer as it came in, the
        tensor the step bound in its place): its value now, written into the memory it came in with."""
        for name, (t, new) in rebound.items():
            self._check(t, new, f"the buffer {name} (rebinding it in a forward or the step)")
        with torch.no_grad():
            for t, came_in in self.came_in.values():
                came_in.copy_(t)
            for t, new in rebound.values():
                t.copy_(new)



def memory_of(inputs: Any) -> dict[int, StorageWeakRef]:
    """Each graph input's memory, by the input's id."""
    return {id(t): StorageWeakRef(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor) and t.layout is torch.strided}


def check_writable(t: torch.Tensor, new: torch.Tensor, what: str, memory: dict[int, StorageWeakRef]) -> None:
    """Refuse setting `what` (graph input `t`) to `new` where the graph cannot write `new`
    into `t`'s memory: another shape, dtype, device or strides, or the memory of another
    input (`memory`: memory_of the inputs), which the two would share from then on."""
    if (t.shape, t.dtype, t.device, t.stride()) != (new.shape, new.dtype, new.device, new.stride()):
        raise CaptureError(
            f"train_step sets {what} of shape {tuple(t.shape)} "
            f"({t.dtype}, strides {t.stride()}) to one of shape {tuple(new.shape)} ({new.dtype}, strides {new.stride()}){where_in_users_code_now()}. "
            "The graph writes such a tensor's new value into its own memory, which needs the same shape, dtype, device and strides; "
            "make the new value like the old one (`.contiguous()`, `.to(dtype)`), or change the tensor outside train_step."
        )
    storage = StorageWeakRef(new.untyped_storage())
    if any(i != id(t) and held == storage for i, held in memory.items()):
        raise CaptureError(
            f"train_step sets {what} to the memory of another graph input{where_in_users_code_now()}, "
            "so that the two would share memory from then on, which a graph run at every step cannot keep. "
            "Assign a copy (`other.clone()`), or copy in place (`with torch.no_grad(): t.copy_(other)`), "
            "or tie the two before compiling."
        )

@contextlib.contextmanager
def data_assignments(inputs: tuple[Any, ...], model: torch.nn.Module, slots: list[tuple[Slot, Any]] = ()) -> Iterator[list[tuple[KeptTensor, Any]]]:
    """While the block runs, `t.data = new` rebinds `t` in the trace; at its end (if it ends
    without an error) the graph inputs so set, and the buffers the step bound to another
    tensor like the one it held, are written with their new values: the model's, and those
    of another module held in `slots` (a teacher: python_state's). The buffers it makes
    (KeptBuffer, with their traced values) go into the list yielded, their tables put back."""
    mode = _DataAssignments(inputs)
    tables = _Tables.of([("model", model), *_modules_in(slots)])  # the traced inputs, while the modules hold them
    made: list[tuple[KeptTensor, Any]] = []
    try:
        with mode:
            yield made
    except BaseException:
        tables.put_back()
        raise
    tables.check_parameters()
    rebound: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module, key, was, now in tables.buffers_changed():
        if was is not None and isinstance(now, torch.Tensor) and _like(was, now):
            rebound[name] = (was, now)
        elif isinstance(now, FakeTensor) and id(now) not in mode.inputs:
            made.append((KeptBuffer(Slot(name, module._buffers, key), keyed=True, module=module, persistent=key not in module._non_persistent_buffers_set), now))
        else:
            tables.put_back()
            set_to = "None" if now is None else "a tensor it did not compute (another input's)" if isinstance(now, torch.Tensor) else type(now).__name__
            raise CaptureError(
                f"train_step sets the buffer {name} to {set_to}, which the graph cannot keep: a buffer the step "
                "makes or rebinds must be a tensor it computes (`self.register_buffer('cache', x.detach().clone())`). "
                "Copy into the buffer in place (`with torch.no_grad(): buf.copy_(new)`), or set it outside train_step."
            )
    tables.put_back()
    mode.write_back(rebound)


def _modules_in(slots: list[tuple[Slot, Any]]) -> list[tuple[str, torch.nn.Module]]:
    """The modules held in the slots, or in a list, tuple or dict a slot holds (a teacher, a list of metrics), by name."""
    found = []
    for slot, value in slots:
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        found += [(slot.name, value)] if isinstance(value, torch.nn.Module) else [(f"{slot.name}[{k!r}]", v) for k, v in items if isinstance(v, torch.nn.Module)]
    return found


def _like(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` can be written into `a`'s memory: the same shape, dtype, device and strides."""
    return (a.shape, a.dtype, a.device, a.stride()) == (b.shape, b.dtype, b.device, b.stride())


@dataclass
class _Tables:
    """Each module's parameters and buffers and its set of non-persistent buffer names, as
    the trace starts (the traced stand-ins, while the model holds them)."""

    held: list[tuple[str, torch.nn.Module, dict[str, Any], dict[str, Any], set[str]]]

    @classmethod
    def of(cls, roots: list[tuple[str, torch.nn.Module]]) -> _Tables:
        """`roots`: the modules, by name (a module held twice is taken where first found)."""
        seen: set[int] = set()
        return cls([
            (f"{root}.{prefix}" if prefix else root, m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
            for root, module in roots for prefix, m in module.named_modules(remove_duplicate=True)
            if id(m) not in seen and not seen.add(id(m)) and not isinstance(m, torch.jit.ScriptModule)  # its tables are TorchScript's, which no forward changes
        ])  # fmt: skip

    def check_parameters(self) -> None:
        """Refuse a parameter the step registered or replaced (its tables put back first)."""
        for prefix, m, params, _, _ in self.held:
            changed = [k for k, p in m._parameters.items() if params.get(k, MISSING) is not p]
            if changed:
                self.put_back()
                name = f"{prefix}.{changed[0]}"
                if params.get(changed[0]) is None:
                    what, advice = f"registers a new parameter, {name},", "Make it in the module's __init__."
                else:
                    what = f"replaces the parameter {name} with another one"
                    advice = "Change the parameter in place (`with torch.no_grad(): p.copy_(new)`, or `p.data = new`), or replace it outside train_step and compile again."
                raise CaptureError(
                    f"train_step {what} (`module.weight = nn.Parameter(...)` in a forward or the step), which the optimizer "
                    f"does not hold and the graph cannot keep. {advice}"
                )

    def buffers_changed(self) -> Iterator[tuple[str, torch.nn.Module, str, Any, Any]]:
        """(name, module, key, the stand-in it held or None, what it holds now) for each buffer entry the step set."""
        for prefix, m, _, buffers, _ in self.held:
            for key, now in m._buffers.items():
                was = buffers.get(key)
                if now is not was:
                    yield f"{prefix}.{key}", m, key, was, now

    def put_back(self) -> None:
        for _, m, params, buffers, non_persistent in self.held:
            for table, held in ((m._parameters, params), (m._buffers, buffers)):
                if table.keys() != held.keys() or any(table[k] is not v for k, v in held.items()):
                    table.clear()
                    table.update(held)
            if m._non_persistent_buffers_set != non_persistent:
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(non_persistent)


_SET_BY_TORCH = frozenset({"_is_param"})  # on a stand-in, by torch.func's reparametrization


def _same_value(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, (bool, int, float, str)) and type(a) is type(b) and a == b)


@contextlib.contextmanager
def attributes_on(real: dict[str, torch.Tensor], stand_ins: dict[str, torch.Tensor], inputs: set[int], kept: list[tuple[Any, Any]]) -> Iterator[None]:
    """While the step is traced, each stand-in holds its tensor's attributes. One the step
    leaves holding a tensor it computed (opacus' `p.grad_sample`) is added to `kept`
    (kept_tensors.KeptTensor: a graph output, set on the real tensor after each run); one
    left otherwise changed is refused, naming it. `inputs`: the graph's, by id."""
    given: dict[str, tuple[set[str], dict[str, Any]]] = {}
    for name, traced in stand_ins.items():
        torchs = set(vars(traced)) | _SET_BY_TORCH  # the fake tensor's own fields
        own = {k: v for k, v in param_hooks.attributes(real[name]).items() if k not in torchs}
        vars(traced).update(own)
        given[name] = (torchs, own)
    yield
    for name, (torchs, own) in given.items():
        now = {k: v for k, v in vars(stand_ins[name]).items() if k not in torchs}
        changed = sorted(k for k in own.keys() | now.keys() if k not in own or k not in now or not _same_value(now[k], own[k]))
        computed = [k for k in changed if isinstance(now.get(k), FakeTensor) and id(now[k]) not in inputs]
        if len(computed) < len(changed):
            raise CaptureError(
                f"train_step sets Python attributes on the model's {name} "
                f"({', '.join(k for k in changed if k not in computed)}) to values other than tensors it computes: the "
                "graph reads a parameter's or buffer's attributes as they were when it was traced, and would not set "
                "them at each run as eager does. Keep such values in the model's modules, or set them between steps."
            )
        kept += [(KeptTensor(Slot(f"model.{name}.{k}", real[name], k), keyed=k not in own), now[k]) for k in computed]
