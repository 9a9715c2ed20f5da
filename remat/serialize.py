"""Plain-JSON documents with a format name and version, checked on load.

Every value remat saves (profiles, plans) is one JSON object whose `"format"` and
`"version"` fields say what it is, so that a file of another kind, or from an
incompatible version, is refused with a message instead of half-read. Never pickle:
a saved profile must be safe to open and readable by other tools.
"""

from __future__ import annotations

import json
import math
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


def dump_document(path: str | Path, fmt: str, version: int, payload: dict[str, Any]) -> Path:
    """Write `payload` as one JSON object headed by its format and version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": fmt, "version": version, **to_jsonable(payload)}
    with path.open("w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"), allow_nan=False)
        f.write("\n")
    return path


def load_document(path: str | Path, fmt: str, version: int) -> dict[str, Any]:
    """Read a document written by `dump_document`; refuse anything else with a PlanError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not a JSON file ({e.msg} at line {e.lineno}); expected a {fmt} file") from None
    if not isinstance(doc, dict):
        raise PlanError(f"{path} holds a JSON {type(doc).__name__}, not a {fmt} object")
    found = doc.get("format")
    if found != fmt:
        what = "has no \"format\" field" if found is None else f"is a {found!r} file"
        raise PlanError(f"{path} {what}; expected \"format\": {fmt!r}. Was it written by remat?")
    found_version = doc.get("version")
    if found_version != version:
        raise PlanError(
            f"{path} is {fmt} version {found_version!r}, but this remat reads version {version}; "
            "regenerate it with this version of remat"
        )
    return doc
