"""Reading the project's TOML files (recipes, chaos and WAN scenarios, ablation suites, the
simulator's calibration) with one set of error messages: every problem is a ``ValueError`` that
names the file and, for a field that does not validate, the field."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["read_toml", "load_toml_model", "field_problems"]

M = TypeVar("M", bound=BaseModel)


def read_toml(path: str | os.PathLike, kind: str = "TOML", example: str | None = None) -> dict:
    """The table of the TOML file at ``path``.

    Args:
        kind: what the file is ("scenario", "suite"), for the message about a folder.
        example: a file name inside that folder to suggest (e.g. ``storm.toml``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path`` is a folder, or the text is not valid TOML (the message names the
            file, the line and the column).
    """
    p = Path(path)
    if p.is_dir():
        hint = f" such as {p}/{example}" if example else ""
        raise ValueError(f"{p} is a directory; give a {kind} file{hint}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{p}: not valid TOML: {err}") from None


def field_problems(err: ValidationError) -> list[str]:
    """One ``field.path: message`` line per error of a pydantic validation."""
    return [(f"{'.'.join(str(x) for x in e['loc'])}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in err.errors()]


def load_toml_model(path: str | os.PathLike, model: type[M], kind: str, example: str | None = None) -> M:
    """Read the TOML file at ``path`` and validate it as ``model``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: as :func:`read_toml`, or a field is missing, unknown or out of range (the
            message names the file and every such field).
    """
    raw = read_toml(path, kind, example)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ValueError(f"{path}: invalid {kind}: " + "; ".join(field_problems(err))) from None
