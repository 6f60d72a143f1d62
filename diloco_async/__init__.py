"""diloco-async: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) with a quorum synchronizer.

The library holds the merge math, the fragment plan, the policies, the synchronizer and the
learner. It never imports Prefect or MLflow; ``flows/`` does.
"""

__version__ = "0.1.0"
