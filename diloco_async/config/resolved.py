"""The resolved config of a run, passed as a value (issue 42, item 2).

A recipe and its ``--set`` strings are parsed once, by :func:`~diloco_async.config.schema.load_config`
at the entry point (the ``train``/``resume`` flows, a harness's CLI); what comes out is a validated
:class:`~diloco_async.config.schema.Config`. The entry point writes it as canonical JSON
(:func:`write_resolved`, ``{workdir}/resolved-config.json``) and every process of the run (the
synchronizer, DDP ranks) reads that value back (:func:`read_resolved`) instead of parsing the recipe
again. Harnesses change a config by typed values (:func:`with_fields`, validated by pydantic), never
by building override strings; :func:`synchronous_diloco` is the synchronous DiLoCo baseline
(paper §6.5, DESIGN §3.7: K = M, no grace window, learners wait at each round).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from diloco_async.config.schema import Config, _format_error, set_dotted

__all__ = ["RESOLVED_CONFIG_FILE", "write_resolved", "read_resolved", "with_fields", "synchronous_fields",
           "decoupled_fields", "synchronous_diloco", "decoupled_diloco"]

#: file name of the resolved config in a run's working folder
RESOLVED_CONFIG_FILE = "resolved-config.json"


def write_resolved(cfg: Config, folder: str | os.PathLike) -> Path:
    """Write ``cfg`` as canonical JSON (every field, secrets included: mode 0600) to
    ``folder/resolved-config.json`` atomically (a temporary file renamed into place); returns the path.

    Raises:
        OSError: the folder cannot be created or written.
    """
    path = Path(folder) / RESOLVED_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cfg.model_dump_json(indent=1))
    os.replace(tmp, path)
    return path


def read_resolved(path: str | os.PathLike) -> Config:
    """The config written by :func:`write_resolved` (no recipe, no overrides: the value itself).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a valid config (the message names the file and every offending field).
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        return Config.model_validate_json(text)
    except ValidationError as err:
        raise ValueError(_format_error(err, str(path))) from None


def with_fields(cfg: Config, fields: Mapping[str, Any]) -> Config:
    """``cfg`` with the fields named ``section.field`` (or ``section.sub.field``) set to typed values,
    validated as a whole by pydantic (cross-field checks included), e.g.
    ``with_fields(cfg, {"learners.count": 4, "budget.wall_s": 60.0})``.

    Raises:
        ValueError: a name without a section, a name under a value, an unknown field or a value
            out of range (the message names every offending field).
    """
    raw = cfg.model_dump()
    for name, value in fields.items():
        set_dotted(raw, name, value, f"field {name!r}")
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ValueError(_format_error(err, f"with fields {', '.join(fields)}")) from None


def synchronous_fields(learners: int) -> dict[str, Any]:
    """The fields of synchronous DiLoCo with ``learners`` learners: quorum K = M, no grace window,
    every learner waits after each contribution until its round published (``learners.barrier``)."""
    return {"synchronizer.min_quorum": int(learners), "synchronizer.grace_enabled": False, "learners.barrier": True}


def decoupled_fields() -> dict[str, Any]:
    """The fields of Decoupled DiLoCo as the paper runs it: quorum K = 1, the adaptive grace window
    (Eq. 3), no barrier."""
    return {"synchronizer.min_quorum": 1, "synchronizer.grace_enabled": True, "learners.barrier": False}


def synchronous_diloco(cfg: Config) -> Config:
    """``cfg`` as synchronous DiLoCo (:func:`synchronous_fields` of ``cfg.learners.count``)."""
    return with_fields(cfg, synchronous_fields(cfg.learners.count))


def decoupled_diloco(cfg: Config) -> Config:
    """``cfg`` as Decoupled DiLoCo (:func:`decoupled_fields`)."""
    return with_fields(cfg, decoupled_fields())
