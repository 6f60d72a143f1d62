"""diloco-async: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) with a quorum synchronizer.

The library holds the merge math, the fragment plan, the policies, the synchronizer and the
learner. It never imports Prefect or MLflow; ``diloco_async/flows/`` does.

``diloco_async.train`` and ``diloco_async.resume`` are :func:`diloco_async.api.train` and
:func:`diloco_async.api.resume` themselves (their signatures and docstrings), imported on first
access (PEP 562), so ``import diloco_async`` stays light.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and readers see; at run time __getattr__ imports them on first use
    from diloco_async.api import resume, train

__version__ = "0.1.0"

__all__ = ["train", "resume", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("train", "resume"):
        from diloco_async import api

        return getattr(api, name)
    raise AttributeError(f"module 'diloco_async' has no attribute {name!r}")
