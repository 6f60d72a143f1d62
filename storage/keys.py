"""Key layout of a run (DESIGN §5). Zero-padded numbers keep listing order numeric."""

from __future__ import annotations

__all__ = ["split_checkpoint_url", "summary_key", "metrics_log_key", "merge_log_key", "plan_key", "config_key",
           "contribution_prefix", "contribution_key", "versions_prefix", "version_key", "version_of_key", "checkpoint_prefix",
           "checkpoint_state_key", "checkpoint_manifest_key", "learner_prefix"]


def plan_key(run_id: str) -> str:
    return f"{run_id}/plan.json"


def config_key(run_id: str) -> str:
    return f"{run_id}/config.json"


def contribution_prefix(run_id: str, fragment: int, round_n: int) -> str:
    """Where every contribution to round ``round_n`` of ``fragment`` lives (ends with "/")."""
    return f"{run_id}/contrib/p{fragment:03d}/r{round_n:08d}/"


def contribution_key(run_id: str, fragment: int, round_n: int, learner: str, nonce: str) -> str:
    return f"{contribution_prefix(run_id, fragment, round_n)}{learner}-{nonce}.safetensors"


def versions_prefix(run_id: str, fragment: int) -> str:
    """Where every published version of ``fragment`` lives (ends with "/")."""
    return f"{run_id}/globals/p{fragment:03d}/"


def version_key(run_id: str, fragment: int, version: int) -> str:
    return f"{versions_prefix(run_id, fragment)}v{version:08d}.safetensors"


def version_of_key(key: str) -> int | None:
    """The version number in a :func:`version_key`, or None for any other key."""
    name = key.rsplit("/", 1)[-1]
    if not (name.startswith("v") and name.endswith(".safetensors") and name[1:-len(".safetensors")].isdigit()):
        return None
    return int(name[1:-len(".safetensors")])


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
