"""diloco-async: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) with a quorum synchronizer.

The library holds the merge math, the fragment plan, the policies, the synchronizer and the
learner. It never imports Prefect or MLflow; ``flows/`` does.
"""

__version__ = "0.1.0"

__all__ = ["train", "resume", "__version__"]


def __getattr__(name: str):
    """``diloco_async.train`` and ``diloco_async.resume`` (:mod:`diloco_async.api`), imported on
    first use so that ``import diloco_async`` stays light."""
    if name in ("train", "resume"):
        from diloco_async import api

        return getattr(api, name)
    raise AttributeError(f"module 'diloco_async' has no attribute {name!r}")
