"""The Prefect pull step of the deployments in ``prefect.yaml``: run each flow in this host's checkout.

A worker starts a flow run in a folder of its own choosing; the deployments' entrypoints
(``diloco_async/flows/train.py:train``) and recipe paths (``configs/default.toml``) are relative to a checkout of
this repository. :func:`set_checkout_directory` changes into the checkout of the host the flow run
is on, found when the flow run starts: ``DILOCO_CHECKOUT`` in the worker's environment, else the
checkout the installed ``flows`` package comes from (an editable install, ``make setup``). So
``prefect deploy`` records no path of the machine it ran on, and the workers of two hosts each run
their own checkout, wherever it is (docs/deployments.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CHECKOUT_ENV", "checkout_directory", "set_checkout_directory"]

#: the worker's environment variable naming its checkout (a container image sets it, e.g. /app)
CHECKOUT_ENV = "DILOCO_CHECKOUT"
#: a file every checkout holds at its root
_MARKER = "prefect.yaml"


def checkout_directory(environ: Mapping[str, str] | None = None) -> Path:
    """This host's checkout: ``environ[CHECKOUT_ENV]`` (default ``os.environ``) when set, else the
    folder above the installed ``diloco_async`` package (``diloco_async/flows/`` is this module's).

    Raises:
        ValueError: the folder holds no ``prefect.yaml`` (not a checkout); the message names it and
            the variable.
    """
    explicit = (os.environ if environ is None else environ).get(CHECKOUT_ENV, "")
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not (path / _MARKER).is_file():
            raise ValueError(f"{CHECKOUT_ENV}={explicit!r} is not a checkout of diloco-async (no {_MARKER} there)")
        return path
    path = Path(__file__).resolve().parents[2]
    if not (path / _MARKER).is_file():
        raise ValueError(f"the installed diloco_async package ({path}) is not in a checkout of diloco-async; set "
                         f"{CHECKOUT_ENV} on the worker to this host's checkout")
    return path


def set_checkout_directory() -> dict[str, str]:
    """Prefect pull step: change the working directory to :func:`checkout_directory`.

    Returns:
        ``{"directory": <the checkout>}`` (the step's output, as Prefect's ``set_working_directory``).

    Raises:
        ValueError: see :func:`checkout_directory`.
    """
    path = checkout_directory()
    os.chdir(path)
    return {"directory": str(path)}
