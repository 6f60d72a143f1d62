"""Ablations of the paper, run by the product: suite files, statistics and verdicts."""
