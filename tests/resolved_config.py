"""Test helper: a recipe and its overrides resolved once, as the processes of a run take them
(``--resolved-config``, :mod:`diloco_async.config.resolved`)."""

from __future__ import annotations

import os
from pathlib import Path


def resolved_args(recipe: str | os.PathLike | None, overrides: list[str], folder: str | os.PathLike) -> list[str]:
    """``["--resolved-config", PATH]``: ``recipe`` with ``overrides`` parsed once and written to
    ``folder/resolved-config.json`` for a synchronizer or DDP rank started by hand."""
    from diloco_async.config.resolved import write_resolved
    from diloco_async.config.schema import load_config

    return ["--resolved-config", str(write_resolved(load_config(recipe, overrides), Path(folder)))]
