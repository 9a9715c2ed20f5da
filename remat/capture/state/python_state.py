"""Python state the graph holds as constants: refused when the step changes it, and a new
compile when the loop does.

The step's Python code runs once, while it is traced; the graph holds the numbers it saw
then as constants. A step that counts its calls in a Python number (`self.steps += 1`, a
global counter) and computes from it (a KL weight warming up, a teacher-forcing ratio)
would repeat its first value at every step, with no error; a list the step appends
`loss.item()` to would hold traced placeholders. And a number the loop sets between steps
(a loss weight in a global, a config field) would keep its first value in the graph.

What is watched (slots.frozen): plain numbers, strings and None, tensors (by shape, dtype
and device: the graph reads them at each call, see outside_tensors), small numpy arrays
and scalars (by value), and lists, tuples, dicts and sets of them (nested), held
- as attributes of the model's modules (all of them), and as data the user's classes of
  those modules hold that their code names (a class default read through `self`, a cache
  their instances share);
- as globals or closure cells of the user's code the step runs: train_step, the functions
  it reaches through its globals and closure, and the methods of the model's classes and
  of the user's objects held there (code outside the installed packages and the standard
  library; a library's code is not followed);
- as fields of the user's objects found there (a trainer whose method is train_step, a
  config object or namespace, an EMA helper), where that code or the object's own
  methods name the field;
- as fields of the user's objects in a list, tuple or dict held there (callbacks), and the
  globals and cells of the user's functions held in fields or such containers;
- as attributes of another module held in those places (a teacher), or in a list or dict
  held there (a list of metrics the step updates), and its modules' train/eval flags;
- and which function a global or closure name holds (a loss function swapped between
  steps).
A dict of numbers and lists of numbers under str keys held outside a module (metrics, a
history of losses) is watched key by key, each key a slot of its own, so that the step
may add to or log into one key (kept_numbers, logged_numbers); so is a dict or list that
also holds what cannot be compared (a deque, a module, an object), a module's too, which
whole would not be watched at all (slots.split).
A tensor the trace computes and leaves in one of these places (`self.last_output =
y.detach()`), or a tuple, list or dict of only such, is set there after each run
(kept_tensors); anything else holding a traced value (such a tensor beside a parameter or
a plain number) is refused: it is a traced placeholder, and no graph output gives it.
A library object's fields holding tensors or numbers are slots too (library_objects), but not
watched: a number the loop changes there is not seen; one the step changes is kept
(kept_numbers), or refused where the graph depends on it.

Only what the step's traces read is watched once it has been traced: the globals the
user's code that ran loads by name, and the fields that code reads or writes
(user_code.recording_run; before the first trace, everything the code could read).
"""

from __future__ import annotations

import copy
import functools
import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import CaptureError
from remat.capture.state import library_objects, module_hooks, outside_tensors, user_code
from remat.capture import param_hooks
from remat.capture.state.slots import (
    CONTAINERS, MISSING, MOST_KEYS, NOT_PLAIN, NUMBERS, PLAIN, TRACED_NUMBERS, Slot, fields_of, frozen, holds, is_number, item_name,
    remade, rounds_in_python, short, shown, slotted_fields, split, thawed,
)

TEXT = (str, bytes)  # what the user's code sets in a slot (a name, a mode), set again after each run as a number is


def module_attributes(model: torch.nn.Module, name: str = "model", skip: frozenset[int] = frozenset()) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """(qualified name, module, key, value) of every value a module holds as an attribute
    (its __dict__, but for nn.Module's own tables and dunder names), but for a DDP wrapper's
    own settings (checked by capture.data_parallel) and the modules in `skip` (by id)."""
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) or id(module) in skip:
            continue
        for key, value in vars(module).items():
            if key not in _MODULE_TABLES and not key.startswith("__"):
                yield f"{name}.{prefix}.{key}" if prefix else f"{name}.{key}", module, key, value
        for tname, t in [*module._parameters.items(), *module._buffers.items()]:  # a flag set on a parameter (param_hooks)
            for key, value in param_hooks.attributes(t).items() if t is not None else ():
                yield f"{name}.{prefix}.{tname}.{key}" if prefix else f"{name}.{tname}.{key}", t, key, value


_MODULE_TABLES = frozenset(vars(torch.nn.Module()))  # nn.Module's own: parameters, buffers, submodules, hooks


def changed_values(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> list[str]:
    """'name (old -> new)' for each value that differs (added or removed ones included)."""
    old, new, gone = dict(before), dict(now), object()

    def held(values: dict[str, Any], k: str) -> str:  # a slot left out of the key holds an object now, or nothing
        return shown(values[k]) if k in values else "an object, or nothing"

    return [f"{k} ({held(old, k)} -> {held(new, k)})" for k in {**old, **new} if old.get(k, gone) != new.get(k, gone)]


def numpy_floats_changed(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> list[str]:
    """The names of the values that changed and hold a numpy float other than float64 now
    (`slots.rounds_in_python`: held by value)."""
    old = dict(before)
    return [k for k, v in now if k in old and old[k] != v and rounds_in_python(thawed(v))]


@dataclass
class _Watched:
    slot: Slot
    value: Any  # the object itself
    frozen: Any  # and what it held
    content: Any = None  # a copy of a container's items (the tensors in it themselves), to put back

    def changed(self) -> bool:
        """Whether the slot holds another value now than it was watched with."""
        return _snapshot(self.slot.get()) != self.frozen

    def put_back(self) -> None:
        if self.slot.get() is not self.value:
            self.slot.set(self.value)
        if isinstance(self.value, (list, dict, set)) and _snapshot(self.value) != self.frozen:
            self.value.clear()
            if isinstance(self.value, list):
                self.value.extend(self.content)
            else:
                self.value.update(self.content)


def state_slots(model: torch.nn.Module, train_step: Callable[..., Any], ran: frozenset[types.CodeType] | None = None) -> list[tuple[Slot, Any]]:
    """Every slot the watch reads (see the module's docstring), with the value it holds:
    those the user's code can reach, or where `ran` is given (the user's code the traces
    ran: user_code.recording_run), those the code that ran names."""
    # The model's modules' attributes: one slot per (module, key), and no dict split by key.
    own = [(Slot(name, module, key), value) for name, module, key, value in module_attributes(model)]
    step_globals = getattr(user_code.user_function(train_step), "__globals__", None)
    hooks = [*param_hooks.functions(model), *module_hooks.functions(model)]
    code = user_code.followed([train_step, getattr(type(train_step), "__call__", None), *user_code.methods(model), *hooks], step_globals, ran)
    out = [*code.bindings, *_class_fields(model, code.names)]
    roots = [(slot.name, value) for slot, value in [*own, *out] if not isinstance(value, PLAIN + CONTAINERS)]
    # The object a method belongs to (a trainer), or the callable object that is the step;
    # and the user's object a hook is a method of (a feature extractor holding its dict).
    bound = train_step
    while isinstance(bound, functools.partial):  # a partial of a trainer's method: the trainer
        bound = bound.func
    owner = bound if user_code.user_class(type(bound)) else getattr(bound, "__self__", None)
    for held in [owner, *(getattr(h, "__self__", None) for h in hooks if isinstance(h, types.MethodType))]:
        if held is not None and (held is owner or user_code.user_class(type(held))):
            roots.append((type(held).__name__, held))
    contained = [item for slot, value in [*own, *out] if isinstance(value, CONTAINERS) for item in _in_container(slot, value)]
    roots += contained
    seen: set[int] = set()
    fields = [f for name, value in roots for f in _object_fields(name, value, code.names, seen, 0, ran)]
    out += fields
    out += library_objects.fields([*roots, *((slot.name, value) for slot, value in fields), *library_objects.reached_through(model)])
    # The user's functions held in those fields or containers (a callback, a closure that
    # counts), and the hooks on another module held there (a teacher's features): their
    # globals and cells too.
    held_functions = [value for _, value in [*fields, *contained] if user_code.user_function(value) is not None]
    held_functions += [fn for _, value in fields if isinstance(value, torch.nn.Module) for fn in module_hooks.functions(value)]
    if held_functions:
        known = {slot.name for slot, _ in out}
        out += [(slot, value) for slot, value in user_code.followed(held_functions, step_globals, ran).bindings if slot.name not in known]
    # Another module the step runs (a teacher, an EMA copy of the model): its attributes and
    # train/eval flags, which its forward is traced with as the model's are.
    # Held in a list or dict too (a list of torchmetrics metrics the step updates in a loop).
    model_modules = frozenset(id(m) for m in model.modules())
    for name, value in [*((slot.name, value) for slot, value in out), *contained]:
        if isinstance(value, torch.nn.Module) and id(value) not in model_modules and id(value) not in seen:
            seen.add(id(value))
            out += [(Slot(n, m, k), v) for n, m, k, v in module_attributes(value, name, model_modules)]
            out += _class_fields(value, code.names)
            out += [
                (Slot(f"{name}.{prefix}.training" if prefix else f"{name}.training", m, "training"), m.training)
                for prefix, m in value.named_modules() if id(m) not in model_modules
            ]
    own = [item for slot, value in own for item in split(slot, value)]
    out = [item for slot, value in out for item in split(slot, value)]
    places: set[tuple[int, str]] = set()  # one name per place: a cell can be seen from two functions' closures
    return own + [(slot, value) for slot, value in out if (place := slot.place()) not in places and not places.add(place)]


def _in_container(slot: Slot, value: Any, index: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    """The user's objects and functions in a list, tuple or dict a slot holds (callbacks), and
    the modules in it or in the lists and dicts in it (metrics, teachers), by name."""
    # Through the base classes' methods, as `holds` looks: no read of a recording list.
    base = next((kind for kind in (list, tuple, dict) if isinstance(value, kind)), None)
    if base is None or base.__len__(value) > MOST_KEYS:
        return []
    if base is dict:
        items = [(f"{index}[{k!r}]", v) for k, v in dict.items(value)]
    else:
        items = [(f"{index}[{i}]", v) for i, v in enumerate(base.__iter__(value))]
    out = []
    for i, v in items:
        if isinstance(v, torch.nn.Module) or (depth == 0 and (user_code.user_class(type(v)) or user_code.user_function(v) is not None)):
            out.append((item_name(slot, i), v))
        elif isinstance(v, (list, tuple, dict)) and depth + 1 < outside_tensors.DEPTH:
            out += _in_container(slot, v, i, depth + 1)
    return out


def _watched(slots: list[tuple[Slot, Any]], library_read: frozenset[tuple[int, str]] = frozenset(), unread: frozenset[int] = frozenset()) -> dict[str, _Watched]:
    """The slots holding plain values (or the user's functions), by name; a library's only
    where a trace read its field (`library_read`: library_objects.recording_reads). The
    containers in `unread` (by id) are compared without their contents."""
    out = {}
    for slot, value in slots:
        if slot.library and not library_objects.read_by_trace(slot, library_read):
            continue
        fz = _snapshot(value, unread)
        if fz is not NOT_PLAIN:
            out[slot.name] = _Watched(slot, value, fz)
    return out


def copied(value: Any) -> Any:
    """A container copied through its nested containers (for `frozen` values: bounded), each of
    its own type: an OrderedDict, Counter or defaultdict (its default too) put back is one still."""
    if isinstance(value, dict):
        items = {k: copied(v) for k, v in dict.items(value)}
        if type(value) is dict:
            return items
        out = copy.copy(value)
        dict.clear(out)
        dict.update(out, items)
        return out
    if isinstance(value, CONTAINERS):
        return remade(type(value), [copied(v) for v in value])
    return value


def step_values(
    model: torch.nn.Module, train_step: Callable[..., Any], skip: set[str] | frozenset[str] = frozenset(), ran: frozenset[types.CodeType] | None = None,
    slots: list[tuple[Slot, Any]] | None = None, library_read: frozenset[tuple[int, str]] = frozenset(),
) -> tuple[tuple[str, Any], ...]:
    """The watched values as the graph traced with them saw them: a step is compiled again
    when one changes between steps (a temperature, a drop rate or a loss weight set by the
    loop), since the graph holds them as constants. `skip`: slots left out (a list the step
    logs numbers to, which the graph never reads). `library_read`: the library fields the
    traces read (library_objects.recording_reads), watched too."""
    slots = state_slots(model, train_step, ran) if slots is None else slots
    # A skipped container held in another slot too (a dict of logs inside the settings
    # dict the step reads) is not compared by its contents there either.
    unread = frozenset(id(value) for slot, value in slots if slot.name in skip and isinstance(value, (list, dict, set)))
    return tuple((name, w.frozen) for name, w in _watched(slots, library_read, unread).items() if name not in skip)


def _object_fields(name: str, obj: Any, names: set[str], seen: set[int], depth: int, ran: frozenset[types.CodeType] | None) -> Iterator[tuple[Slot, Any]]:
    """The fields of a user's object, class, module or function (a `CFG` class or a config
    module the step reads `CFG.aux` of), and of the user's objects in them, that the user's code names."""
    path = getattr(obj, "__file__", None) if isinstance(obj, types.ModuleType) else None
    if isinstance(obj, type):
        ours = user_code.user_class(obj) and not issubclass(obj, torch.nn.Module)
    elif isinstance(obj, types.FunctionType):  # its attributes (`train_step.calls += 1`)
        ours = user_code.user_function(obj) is obj
    else:
        ours = user_code.user_class(type(obj)) or (isinstance(path, str) and user_code.is_user_file(path))
    if depth > 3 or id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.Tensor)) or not ours:
        return
    seen.add(id(obj))
    fields = fields_of(obj)
    fields = slotted_fields(obj) if fields is None else fields
    names = names | user_code.names_in_class(type(obj), ran)  # what its own methods name (an EMA helper's update())
    for key in sorted(k for k in fields if k in names):
        yield Slot(f"{name}.{key}", obj, key), fields[key]
        yield from _object_fields(f"{name}.{key}", fields[key], names, seen, depth + 1, ran)
    if not isinstance(obj, (type, types.ModuleType, types.FunctionType)):  # what `self.aux` reads where the class holds it
        # The object's own field of that name, absent (MISSING) while the class holds it: `self.aux = ...` in the
        # step or the loop then shadows the class's, which the key and the guards see.
        shadowed = {k for cls in type(obj).__mro__ for k, v in vars(cls).items() if k in names and k not in fields and _data(v)}
        for key in sorted(shadowed) if fields_of(obj) is not None else ():
            yield Slot(f"{name}.{key}", obj, key), MISSING
        for cls in type(obj).__mro__:
            yield from _object_fields(f"{name} (class {cls.__name__})", cls, names, seen, depth + 1, ran)


def _class_fields(model: torch.nn.Module, names: set[str]) -> list[tuple[Slot, Any]]:
    """The data the user's classes of the model's modules hold (`temperature = 1.0`, a mask
    cache `_masks = {}` their instances share), read through `self` where no instance
    shadows it: a slot of the class, for each field the user's code names."""
    found, seen = [], set()
    for cls in (c for kind in dict.fromkeys(type(m) for m in model.modules()) for c in kind.__mro__):
        if id(cls) in seen or not user_code.user_class(cls):
            continue
        seen.add(id(cls))
        found += [(Slot(f"{cls.__qualname__}.{k}", cls, k), v) for k, v in vars(cls).items() if k in names and not k.startswith("__") and _data(v)]
    return found


def _data(value: Any) -> bool:
    """A class attribute holding data (a default an instance may shadow), not a method or descriptor."""
    return not (callable(value) or hasattr(type(value), "__get__"))


def _snapshot(value: Any, unread: frozenset[int] = frozenset()) -> Any:
    """What a watched value is compared by: its frozen copy (the containers in `unread`
    without their contents), or which function it is."""
    fn = user_code.user_function(value) if isinstance(value, types.FunctionType) else None
    return _FunctionRef(fn) if fn is not None else frozen(value, unread)


class _FunctionRef:
    """Which function a name holds: equal only to the same function."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FunctionRef) and other.fn is self.fn

    def __hash__(self) -> int:
        return id(self.fn)

    def __repr__(self) -> str:
        return self.fn.__qualname__


@dataclass(frozen=True)
class NumberChange:
    """A slot a trace left holding a number (plain, or traced: `loss.item()`) other than the
    one it held before, a number, None or nothing (MISSING)."""

    slot: Slot
    before: Any
    after: Any


def same_number(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN is the same NaN


def _keys(container: Any) -> set[Any]:
    return set(container) if isinstance(container, dict) else set(range(len(container)))


class StateWatch:
    """The state before the capture, as no_python_state_changed watches it."""

    def __init__(self, model: torch.nn.Module, train_step: Callable[..., Any], slots: list[tuple[Slot, Any]]) -> None:
        self.model, self.train_step = model, train_step
        self.held = {slot.name: value for slot, value in slots}
        # A dict split by key (slots.split): the dict itself, and its keys, to drop those a refused trace added
        # (a list split by index: its indices).
        self.split = {slot.owner.name: (slot.owner, _keys(slot.owner.get())) for slot, _ in slots if isinstance(slot.owner, Slot)}
        self.held.update({name: parent.get() for name, (parent, _) in self.split.items()})
        self.before = watched_now(slots)
        self.set_up: set[str] = set()  # slots the step's first run sets once (first_call): put back, not refused

    def refuse_traced_tensors(self) -> None:
        """Refuse a tensor a trace left in the state (a cache made at the first call) before
        the state is traced again: the next trace would read another trace's placeholder."""
        kept = [slot.name for slot, value in state_slots(self.model, self.train_step) if holds_traced_value(value, False)]
        if kept:
            raise kept_error(kept)

    def numbers_changed(self, set_up: frozenset[tuple[int, str]] = frozenset()) -> list[NumberChange]:
        """The slots the traces so far left holding another number, or the user's code another
        text (capture.state.kept_numbers), each put back; but for the places in `set_up` (a library's first-call mark:
        module_hooks), which capture puts back itself."""
        changes = []
        for slot, value in state_slots(self.model, self.train_step):
            if slot.place() in set_up or slot.name in self.set_up:
                continue
            w = self.before.get(slot.name)
            before = self.held.get(slot.name, MISSING)
            plain_before = before is None or before is MISSING or type(before) in NUMBERS
            if (is_number(value) and plain_before) or (not slot.library and type(value) in TEXT and (plain_before or type(before) in TEXT)):
                if slot.library and type(value) is type(before) and same_number(value, before):
                    continue  # a library's number, not watched: changed only if it holds another
                if w is None or _snapshot(value) != w.frozen:
                    changes.append(NumberChange(slot, before, value))
                    slot.set(before)
        return changes


@contextlib.contextmanager
def no_python_state_changed(model: torch.nn.Module, train_step: Callable[..., Any], slots: list[tuple[Slot, Any]]) -> Iterator[StateWatch]:
    """Around the whole capture: refuse, naming them, the watched values the traces changed
    and the tensors (or traced numbers) they left in Python state, putting everything back
    as it was (so that a refused capture leaves nothing changed). `slots`: state_slots
    before the capture."""
    watch = StateWatch(model, train_step, slots)
    held, before = watch.held, watch.before
    _CAPTURES.append(watch)
    try:
        yield watch
    except BaseException:  # a capture that failed leaves the state as it found it too
        for slot, value in state_slots(model, train_step):
            if slot.name not in before and holds_traced_value(value, True):
                slot.set(held.get(slot.name, MISSING))
        _drop_new_keys(watch)
        for w in before.values():
            w.put_back()
        raise
    finally:
        _CAPTURES.remove(watch)
    # A traced number in a slot watched before is named as a change (the message says where to log it).
    kept = [slot for slot, value in state_slots(model, train_step) if holds_traced_value(value, slot.name not in before)]
    for slot in kept:
        if slot.name not in before:
            slot.set(held.get(slot.name, MISSING))
    kept_names = {slot.name for slot in kept}
    changed = [f"{name} (absent -> {short(repr(value))})" for name, value in _new_keys(watch) if name not in kept_names]
    _drop_new_keys(watch)
    for name, w in before.items():
        value = w.slot.get()
        now = _snapshot(value)
        if now is not w.frozen and now != w.frozen:
            text = shown(now) if now is not NOT_PLAIN else "deleted" if value is MISSING else short(repr(value))
            if name not in kept_names and name not in watch.set_up:
                changed.append(f"{name} ({shown(w.frozen)} -> {text})")
            w.put_back()
    if changed:
        raise CaptureError(
            f"train_step changed Python state while it was traced: {_listed(changed)}. Its Python code runs once, at "
            "capture, so the graph would repeat the first value at every step (and a value kept from inside the step "
            "would be a traced placeholder, not a number). Keep such state outside train_step and pass what the step "
            "computes from it as a tensor (in the batch, or a buffer of the model updated between steps); to log a "
            "value, return it from train_step or append it to a list of your own (a global, a closure's, an attribute)."
        )
    if kept:
        raise kept_error([slot.name for slot in kept])


_CAPTURES: list[StateWatch] = []  # the captures under way, the innermost last


def watched_now(slots: list[tuple[Slot, Any]]) -> dict[str, _Watched]:
    """The slots' plain values as they are now, by name, each able to say whether it changed
    since and to put itself back (a container's items too)."""
    now = _watched(slots)
    for w in now.values():
        w.content = copied(w.value)
    return now


def put_back_as_now() -> Callable[[], None]:
    """The state the capture under way watches, as it is now, as a function that puts it
    back: a trace that fails midway (and is made again, knowing more) may have set state
    its code sets back only on success (Lightning's name of the hook running), and the
    next trace must start from the state this one started from."""
    if not _CAPTURES:
        return lambda: None
    now = watched_now([(w.slot, w.slot.get()) for w in _CAPTURES[-1].before.values()])
    return lambda: [w.put_back() for w in now.values()] and None


def _new_keys(watch: StateWatch) -> list[tuple[str, Any]]:
    """(name, value) of each key the traces added to a dict split by key (a list made with
    `logs.setdefault("times", [])` in a dict of numbers)."""
    out = []
    for parent, keys in watch.split.values():
        held_now = parent.get()
        out += [(item_name(parent, f"[{k!r}]"), v) for k, v in held_now.items() if k not in keys] if isinstance(held_now, dict) else []
    return out


def _drop_new_keys(watch: StateWatch) -> None:
    """The keys the traces added to a dict split by key, dropped."""
    for parent, keys in watch.split.values():
        held_now = parent.get()
        for key in [k for k in held_now if k not in keys] if isinstance(held_now, dict) else []:
            del held_now[key]


def kept_error(names: list[str]) -> CaptureError:
    """The refusal of the slots named, each holding a traced value."""
    return CaptureError(
        f"train_step kept a tensor (or a number computed from one) in Python state: {_listed(names)}. "
        "Its Python code runs once, at capture: there the value is a traced placeholder, and at run time the graph "
        "computes it but stores it nowhere, so it would never hold a step's value. Return it from train_step instead (a tuple "
        "or dict of the loss and the tensors to keep), keep it directly in a list or dict of your own held in a global, a "
        "closure or an attribute (stats.append(t), features[name] = t: set after each run), or, if nothing reads it after "
        "the step, drop it before train_step returns (.clear() the dict, del the attribute). A tensor the step computes, or "
        "a tuple, list or dict of only such tensors (an RNN's hidden state), is set there after each run; one holding a "
        "parameter or a plain number beside them is not."
        + (
            " A list the step makes under a new key (logs.setdefault('loss', []).append(...)) is made once, at capture: "
            "make the key before the first step, or hold a collections.defaultdict(list), whose keys remat makes as the "
            "step reads them."
            if any("[" in name for name in names) else ""
        )
    )


def holds_traced_value(value: Any, numbers: bool) -> bool:
    """Whether `value` is, or a list, tuple or dict holds, a tensor (or if `numbers`, a
    number) made while tracing."""
    return holds(value, lambda v: isinstance(v, (FakeTensor, *(TRACED_NUMBERS if numbers else ()))))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

