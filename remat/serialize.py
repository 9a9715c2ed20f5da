"""Plain-JSON documents with a format name and version, checked on load.

Every value remat saves (profiles, plans) is one JSON object whose `"format"` and
`"version"` fields say what it is, so that a file of another kind, or from an
incompatible version, is refused with a message instead of half-read. Never pickle:
a saved profile must be safe to open and readable by other tools.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from remat.errors import PlanError


def to_jsonable(value: Any) -> Any:
    """Numpy scalars/arrays, enums, tuples and paths as plain JSON values."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value") and isinstance(getattr(value, "value"), (str, int)):  # Enum
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot store the non-finite number {value} in JSON")
    return value


MAX_DOCUMENT_BYTES = 1 << 30  # a profile of a large model is a few MB; refuse anything absurd unread


def dump_document(path: str | Path, fmt: str, version: int, payload: dict[str, Any]) -> Path:
    """Write `payload` as one JSON object headed by its format and version.

    Atomic: the text goes to a temporary file beside `path`, which then replaces it, so
    an interrupted or failed save leaves the previous file whole, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": fmt, "version": version, **to_jsonable(payload)}
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n"
    write_atomic(path, text)
    return path


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename (never half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="") as f:  # the text as given (CSV has its own line ends)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before it takes the name: a crash leaves the old file or the new one
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class _NotJson(Exception):
    """NaN or Infinity in a file: Python's json reads them, JSON has no such values."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


def _truncated(text: str, e: json.JSONDecodeError) -> bool:
    """Whether the text reads as the start of a JSON document cut short (not junk)."""
    body = text.rstrip()
    if not body.lstrip().startswith(("{", "[")):
        return False
    if e.msg.startswith("Unterminated string"):
        return True
    rest = body[e.pos :]
    return not rest or any(lit.startswith(rest) for lit in ("true", "false", "null")) or re.fullmatch(r"[-+0-9.eE]+", rest) is not None


def load_document(path: str | Path, fmt: str, version: int, untagged: bool = False) -> dict[str, Any]:
    """Read a document written by `dump_document`; refuse anything else with a PlanError.

    Only `json.loads` ever reads the text: nothing is unpickled or evaluated. Pickles
    (torch.save output included) are recognised by their first bytes and refused unread.
    `untagged`: also accept an object with neither "format" nor "version" (files from
    before they were tagged); the caller checks its fields.
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise PlanError(f"{path} is a directory, not a {fmt} file")
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise PlanError(f"{path} is {size} bytes, too large for a {fmt} file (at most {MAX_DOCUMENT_BYTES}); refused unread")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file") from None
    except OSError as e:
        raise PlanError(f"{path}: cannot read it ({e.strerror or e})") from None
    if raw[:1] == b"\x80" and raw[1:2] and 2 <= raw[1] <= 5:
        raise PlanError(
            f"{path} is a Python pickle, not a JSON file: remat never unpickles files (loading one can run any code). "
            f"Expected a {fmt} JSON file written by remat."
        )
    if raw[:4] == b"PK\x03\x04":
        raise PlanError(
            f"{path} is a zip archive (torch.save output?), not a JSON file: remat never unpickles files (loading one can run "
            f"any code). Expected a {fmt} JSON file written by remat."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError(f"{path} is not a text file (not UTF-8); expected a {fmt} JSON file") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark some editors add
    if not text.strip():
        raise PlanError(f"{path} is empty; expected a {fmt} file")
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except _NotJson as e:
        raise PlanError(f"{path} holds {e}, which is not JSON (remat never writes it): the file was edited or damaged") from None
    except json.JSONDecodeError as e:
        if _truncated(text, e):
            raise PlanError(
                f"{path} is truncated: its JSON ends before it is complete ({e.msg} at line {e.lineno}, of {len(raw)} bytes); "
                f"expected a {fmt} file. Was it copied or written only in part?"
            ) from None
        raise PlanError(f"{path} is not a JSON file ({e.msg} at line {e.lineno}); expected a {fmt} file") from None
    except RecursionError:
        raise PlanError(f"{path} nests too deeply to be a {fmt} file") from None
    if not isinstance(doc, dict):
        raise PlanError(f"{path} holds a JSON {_json_kind(doc)}, not a {fmt} object")
    found = doc.get("format")
    if untagged and found is None and "version" not in doc:
        return doc
    if found != fmt:
        what = "has no \"format\" field" if found is None else f"is a {found!r} file"
        raise PlanError(f"{path} {what}; expected \"format\": {fmt!r}. Was it written by remat?")
    found_version = doc.get("version")
    if type(found_version) is int and found_version > version:
        raise PlanError(
            f"{path} is {fmt} version {found_version}, but this remat reads version {version}: the file was written by a "
            "newer remat. Upgrade remat, or regenerate the file with this one."
        )
    if type(found_version) is not int or found_version != version:
        raise PlanError(
            f"{path} is {fmt} version {found_version!r}, but this remat reads version {version}; "
            "regenerate it with this version of remat"
        )
    return doc


# ---------------------------------------------------------------------- field checks


def _json_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return "literal"
    return "number"


def describe_value(value: Any) -> str:
    """A JSON value as a message names it: `-1`, `the string 'x'`, `a list`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class _Mismatch(Exception):
    def __init__(self, path: str, detail: str):
        super().__init__(f"{path} {detail}")
        self.path, self.detail = path, detail


def _expected(hint: Any, sign: str | None) -> str:
    """What a type hint asks for, in words ("a non-negative integer or null")."""
    if hint is Any:
        return "any value"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(a, sign) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if hint is bool:
        return "true or false"
    if hint is int:
        return f"a {sign} integer" if sign else "an integer"
    if hint is float:
        return f"a {sign} number" if sign else "a number"
    if hint is str:
        return "a string"
    if origin is list:
        return "a list"
    if origin is tuple:
        return f"a list of {len(typing.get_args(hint))} items"
    if origin is dict or dataclasses.is_dataclass(hint):
        return "an object"
    return getattr(hint, "__name__", str(hint))


def _conforms(value: Any, hint: Any, sign: str | None) -> bool:
    """Whether `value` is of `hint` at its top level (containers: not their items)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a, sign) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, int if hint is int else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        return sign is None or (value > 0 if sign == "positive" else value >= 0)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list)
    if origin is tuple:
        return isinstance(value, list) and len(value) == len(typing.get_args(hint))
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return isinstance(value, hint)


def _check_value(value: Any, hint: Any, path: str, signs: dict[type, dict[str, str]], sign: str | None) -> None:
    if not _conforms(value, hint, sign):
        detail = f"must be {_expected(hint, sign)}, not {describe_value(value)}"
        if typing.get_origin(hint) is tuple and isinstance(value, list):
            detail = f"must be {_expected(hint, sign)}, not a list of {len(value)}"
        raise _Mismatch(path, detail)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(hint):
            if _conforms(value, a, sign):
                _check_value(value, a, path, signs, sign)
                return
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        for i, x in enumerate(value):
            _check_value(x, item, f"{path}[{i}]", signs, sign)
    elif origin is tuple:
        for i, (x, item) in enumerate(zip(value, typing.get_args(hint))):
            _check_value(x, item, f"{path}[{i}]", signs, sign)
    elif origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        for k, x in value.items():
            _check_value(x, item, f"{path}[{json.dumps(k)}]", signs, sign)
    elif dataclasses.is_dataclass(hint):
        _check_object(value, hint, path, signs)


def _check_object(d: dict[str, Any], cls: type, path: str, signs: dict[type, dict[str, str]]) -> None:
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - d.keys())
    hint = "; was it written by this version of remat?"
    if missing:
        raise _Mismatch(path, ("is missing" if path else "missing") + f" the field(s) {', '.join(missing)}{hint}")
    unknown = sorted(d.keys() - names)
    if unknown:
        raise _Mismatch(path, ("has unknown" if path else "unknown") + f" field(s) {', '.join(unknown)}{hint}")
    hints = typing.get_type_hints(cls)
    own = signs.get(cls, {})
    for f in fields:
        if f.name in d:
            _check_value(d[f.name], hints[f.name], f"{path}.{f.name}" if path else f.name, signs, own.get(f.name))


def check_fields(doc: dict[str, Any], cls: type, where: str, signs: dict[type, dict[str, str]] | None = None) -> None:
    """Refuse a document whose fields are not exactly those of dataclass `cls`, of its types.

    Types come from the dataclass annotations, nested dataclasses and containers
    included: an integer is not a bool nor a float, a number is finite. `signs` marks
    fields (per dataclass) "non-negative" or "positive" (all numbers inside them). The
    PlanError names the first offending field by its path, e.g.
    `plan.json: recomputed[0].nbytes must be a non-negative integer, not -1`.
    """
    d = {k: v for k, v in doc.items() if k not in ("format", "version")}
    try:
        _check_object(d, cls, "", signs or {})
    except _Mismatch as e:
        raise PlanError(f"{where}: {e.detail if not e.path else f'{e.path} {e.detail}'}") from None
