"""The resume's config, resolved once at the entry point (issue 42, item 2).

``diloco-async resume``, the ``resume`` flow and the ``synchronizer`` deployment take a checkpoint
URL, an optional recipe and ``--set`` strings; :func:`resume_config` parses them once into a
:class:`~diloco_async.config.schema.Config` (the recipe, or without one the run's own stored
``config.json``, with the overrides applied). The processes then get that value;
:func:`~diloco_async.sync.persistence.open_checkpoint` checks it against the checkpoint. Imports
are lazy: :mod:`flows.deployments` loads nothing but Prefect at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_async.config.schema import Config

__all__ = ["resume_config", "write_recipe_resolved"]


def write_recipe_resolved(recipe: str | None, overrides: list[str], folder: str) -> str:
    """Resolve ``recipe`` (a path or a shipped recipe's name; None: the defaults) with ``overrides``
    and write it to ``folder/resolved-config.json`` (``diloco-async validate --write-resolved``: the
    file ``python -m diloco_async.server --resolved-config`` takes in a run started by hand); its path.

    Raises:
        FileNotFoundError: no such recipe. ValueError: it does not validate.
    """
    from diloco_async.config.resolved import write_resolved
    from diloco_async.config.schema import load_config
    from diloco_async.validate import resolve_recipe

    return str(write_resolved(load_config(None if recipe is None else resolve_recipe(recipe), overrides), folder))


def resume_config(checkpoint_url: str, config: str | None, overrides: list[str],
                  storage_options: dict) -> Config | None:
    """The config of a resume: ``config`` (a recipe path) with ``overrides``; without a recipe the
    run's stored config with them; None without either (the synchronizer then takes the stored
    config as it is).

    Raises:
        FileNotFoundError: no such recipe.
        ValueError: the URL is malformed, the store holds no such run, or an override is invalid.
    """
    from diloco_async.config.schema import load_config
    from diloco_async.sync.persistence import stored_config

    if config is None and not overrides:
        return None
    base = stored_config(checkpoint_url, storage_options) if config is None else None
    return load_config(config, overrides, base=base)
