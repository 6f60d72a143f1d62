"""diloco-async: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) with a quorum synchronizer.

The library holds the merge math, the fragment plan, the policies, the synchronizer and the
learner. It never imports Prefect or MLflow; ``diloco_async/flows/`` does.
"""

__version__ = "0.1.0"

__all__ = ["train", "resume", "__version__"]


def train(*args, **kwargs) -> dict:
    """:func:`diloco_async.api.train` (imported on the first call: ``import diloco_async`` stays light)."""
    from diloco_async.api import train as run_train

    return run_train(*args, **kwargs)


def resume(*args, **kwargs) -> dict:
    """:func:`diloco_async.api.resume` (imported on the first call)."""
    from diloco_async.api import resume as run_resume

    return run_resume(*args, **kwargs)
