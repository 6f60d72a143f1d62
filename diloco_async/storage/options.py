"""Storage options (fsspec endpoints, credentials) handed to child processes in the environment.

A parent (the train flow, a DDP group, a Prefect deployment) puts the run's options, as JSON,
in :data:`STORAGE_OPTIONS_ENV`; the child (synchronizer, learner, DDP rank, checkpoint flow)
reads them back with :func:`storage_options_from_env`. They travel in the environment, never on
a command line, and are never logged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["STORAGE_OPTIONS_ENV", "storage_options_from_env"]

#: name of the environment variable holding the storage options as a JSON object
STORAGE_OPTIONS_ENV = "DILOCO_STORAGE_OPTIONS"


def storage_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The storage options in :data:`STORAGE_OPTIONS_ENV` (``{}`` when unset or empty).

    Args:
        environ: the environment to read (default: ``os.environ``).

    Raises:
        ValueError: the variable is not valid JSON, or not a JSON object; the message names the
            variable but never repeats its value (it may hold credentials).
    """
    text = (os.environ if environ is None else environ).get(STORAGE_OPTIONS_ENV, "") or "{}"
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{STORAGE_OPTIONS_ENV} is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise ValueError(f"{STORAGE_OPTIONS_ENV} must be a JSON object, got {type(options).__name__}")
    return options
