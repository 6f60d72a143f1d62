"""Key layout of a run (DESIGN §5). Zero-padded numbers keep listing order numeric."""

from __future__ import annotations

__all__ = ["split_checkpoint_url", "summary_key", "metrics_log_key", "merge_log_key", "plan_key", "config_key", "contribution_key", "version_key", "checkpoint_prefix",
           "checkpoint_state_key", "checkpoint_manifest_key", "learner_prefix"]


def plan_key(run_id: str) -> str:
    return f"{run_id}/plan.json"


def config_key(run_id: str) -> str:
    return f"{run_id}/config.json"


def contribution_key(run_id: str, fragment: int, round_n: int, learner: str, nonce: str) -> str:
    return f"{run_id}/contrib/p{fragment:03d}/r{round_n:08d}/{learner}-{nonce}.safetensors"


def version_key(run_id: str, fragment: int, version: int) -> str:
    return f"{run_id}/globals/p{fragment:03d}/v{version:08d}.safetensors"


def checkpoint_prefix(run_id: str) -> str:
    return f"{run_id}/checkpoints"


def checkpoint_state_key(run_id: str, seq: int) -> str:
    return f"{run_id}/checkpoints/{seq:08d}/state.safetensors"


def checkpoint_manifest_key(run_id: str, seq: int) -> str:
    return f"{run_id}/checkpoints/{seq:08d}/manifest.json"


def summary_key(run_id: str, epoch: str) -> str:
    """Final figures written by one synchronizer process (an epoch) of the run."""
    return f"{run_id}/epochs/{epoch}/summary.json"


def metrics_log_key(run_id: str, epoch: str) -> str:
    return f"{run_id}/epochs/{epoch}/metrics.jsonl"


def merge_log_key(run_id: str, epoch: str) -> str:
    """JSON lines, one per merge: unix time, fragment, round, version, merged update ids."""
    return f"{run_id}/epochs/{epoch}/merges.jsonl"


def learner_prefix(run_id: str, learner: str) -> str:
    return f"{run_id}/learners/{learner}"


def split_checkpoint_url(url: str) -> tuple[str, str, int | None]:
    """Split ``{root}/{run_id}/checkpoints/{seq}`` (or ``{root}/{run_id}``, meaning the newest
    verified checkpoint) into (root URL, run id, seq or None).

    Raises:
        ValueError: the URL names neither a run nor one of its checkpoints.
    """
    url = url.rstrip("/")
    if url.endswith("/manifest.json"):
        url = url.rsplit("/", 1)[0]
    if "/checkpoints/" in url:
        head, seq = url.rsplit("/checkpoints/", 1)
        if not seq.isdigit():
            raise ValueError(f"{url!r}: checkpoint sequence {seq!r} is not a number")
        root, _, run_id = head.rpartition("/")
        return root, run_id, int(seq)
    if url.endswith("/checkpoints"):
        url = url[: -len("/checkpoints")]
    root, _, run_id = url.rpartition("/")
    if not root or not run_id or root.endswith(":/"):
        raise ValueError(f"{url!r} does not name a run ({{root}}/{{run_id}}) or a checkpoint")
    return root, run_id, None
