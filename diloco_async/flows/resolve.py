"""Configs resolved once at an entry point (issue 42, item 2): a resume's, an ablation suite's
arms', and the file a run started by hand takes.

``diloco-async resume``, the ``resume`` flow and the ``synchronizer`` deployment take a checkpoint
URL, an optional recipe and ``--set`` strings; :func:`resume_config` parses them once into a
:class:`~diloco_async.config.schema.Config` (the recipe, or without one the run's own stored
``config.json``, with the overrides applied). The processes then get that value;
:func:`~diloco_async.sync.persistence.open_checkpoint` checks it against the checkpoint. Imports
are lazy: :mod:`diloco_async.flows.deployments` loads nothing but Prefect at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_async.ablation.suite import Suite
    from diloco_async.config.schema import Config

__all__ = ["resume_config", "write_recipe_resolved", "check_arms"]


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
    from diloco_async.sync import stored_config

    if config is None and not overrides:
        return None
    base = stored_config(checkpoint_url, storage_options) if config is None else None
    return load_config(config, overrides, base=base)


def check_arms(suite: Suite, extra: Sequence[str] = ()) -> dict[str, Config]:
    """Resolve every arm's recipe once (the suite's recipe with
    :func:`~diloco_async.ablation.suite.arm_overrides`) and build its run config at the first seed;
    arm name -> config.

    Raises:
        ValueError: naming the arm when one does not validate (e.g. a key this build does not have),
            or when ``extra`` sets a field the suite owns (:func:`~diloco_async.ablation.suite.check_extra`).
    """
    from diloco_async.ablation.suite import arm_overrides, check_extra, run_config
    from diloco_async.config.schema import load_config

    check_extra(suite, extra)
    out = {}
    for arm in suite.arms:
        try:
            base = load_config(suite.suite.config, arm_overrides(suite, arm, extra))
            out[arm.name] = run_config(suite, arm, suite.suite.seeds[0], base)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"suite {suite.suite.name!r}, arm {arm.name!r}: {err}") from None
    return out
