"""Key layout of a run (DESIGN §5). Zero-padded numbers keep listing order numeric.

Every object key of a run is built here, and keys read back from a listing are parsed here::

    {run_id}/plan.json, config.json
    {run_id}/contrib/p{fragment:03d}/r{round:08d}/{learner}-{nonce}.safetensors
    {run_id}/contrib/p{fragment:03d}/r{round:08d}/{learner}-{nonce}.rank{r:03d}of{N:03d}.safetensors  (sharded group)
    {run_id}/globals/p{fragment:03d}/v{version:08d}.safetensors
    {run_id}/checkpoints/{seq:08d}/state.safetensors, manifest.json   (synchronizer)
    {run_id}/ddp/checkpoints/{seq:08d}/...                             (data-parallel baseline)
    {run_id}/learners/{learner}/{seq:08d}/...                          (a learner's inner state)
    {run_id}/epochs/{epoch}/summary.json, metrics.jsonl, merges.jsonl
    {run_id}/lease/{lease_epoch:08d}/claim.json, renewal-{k:08d}.json, released.json  (fencing)
    {run_id}/shards.json                                               (the shard assignment, S > 1)

With ``synchronizer.shards = S > 1`` what one synchronizer shard's lifetime owns (its lease,
checkpoints and epochs) lies under ``{run_id}/shards/{shard:03d}/`` instead of ``{run_id}/``
(:func:`synchronizer_root`); fragment objects (contributions, versions, compact forms) keep their
keys, since the shards' fragments are disjoint. With S = 1 every key is as above.

A *state folder* ``{prefix}/{seq:08d}/`` holds ``state.safetensors`` and its ``manifest.json``
(:mod:`diloco_async.storage.checkpoint`); checkpoints, DDP checkpoints and learners' inner states are state
folders under their own prefix.
"""

from __future__ import annotations

import re

__all__ = ["plan_key", "config_key", "synchronizer_root", "shards_manifest_key",
           "contributions_prefix", "contribution_round_prefix", "contribution_key", "contribution_shard_key",
           "parse_contribution_key",
           "contribution_learner",
           "versions_prefix", "fragment_versions_prefix", "version_key", "parse_version_key",
           "compact_prefix", "compact_key", "parse_compact_key",
           "state_folder", "state_file_key", "state_manifest_key", "state_seq_of", "split_state_key",
           "checkpoint_prefix", "checkpoint_state_key", "checkpoint_manifest_key", "checkpoint_url",
           "split_checkpoint_url", "run_manifest_key", "run_manifest_seq", "ddp_checkpoint_prefix", "learner_prefix",
           "summary_key", "metrics_log_key", "merge_log_key", "contribution_log_key", "final_model_prefix",
           "lease_prefix", "lease_claim_key", "lease_renewal_key", "lease_released_key", "parse_lease_key"]

_CONTRIB, _GLOBALS, _CHECKPOINTS = "contrib", "globals", "checkpoints"
_STATE_FILE, _MANIFEST = "state.safetensors", "manifest.json"
_CONTRIB_SUFFIX = ".safetensors"
_CONTRIB_RE = re.compile(rf"^{_CONTRIB}/p(\d+)/r(\d+)/")
_VERSION_RE = re.compile(rf"^{_GLOBALS}/p(\d+)/v(\d+)\b")
_COMPACT = "compact"
_COMPACT_RE = re.compile(rf"^{_COMPACT}/p(\d+)/v(\d+)\b")
_LEASE = "lease"
_LEASE_RE = re.compile(r"^(\d{8})/(claim|renewal-(\d{8})|released)\.json$")


def plan_key(run_id: str) -> str:
    return f"{run_id}/plan.json"


def config_key(run_id: str) -> str:
    return f"{run_id}/config.json"


def synchronizer_root(run_id: str, shard: int = 0, shards: int = 1) -> str:
    """Where synchronizer shard ``shard`` of ``shards`` keeps what its lifetime owns (lease,
    checkpoints, epochs): ``run_id`` itself when ``shards == 1`` (every key as before shards
    existed), else ``{run_id}/shards/{shard:03d}``. The lease, checkpoint and epoch key functions
    take this root in place of the run id.

    Raises:
        ValueError: ``shard`` outside ``[0, shards)``.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is outside [0, {shards}) for synchronizer.shards={shards}")
    return run_id if shards == 1 else f"{run_id}/shards/{shard:03d}"


def shards_manifest_key(run_id: str) -> str:
    """The run's shard assignment (``{"shards", "fragments", "schema_hash"}``), created once by the
    first shard to start; only when ``synchronizer.shards > 1``."""
    return f"{run_id}/shards.json"


# -- contributions and global versions -------------------------------------------------------


def contributions_prefix(run_id: str) -> str:
    """Every contribution of a run lies under this prefix."""
    return f"{run_id}/{_CONTRIB}"


def contribution_round_prefix(run_id: str, fragment: int, round_n: int) -> str:
    """The contributions to round ``round_n`` of ``fragment`` lie under ``{this}/``."""
    return f"{contributions_prefix(run_id)}/p{fragment:03d}/r{round_n:08d}"


def contribution_key(run_id: str, fragment: int, round_n: int, learner: str, nonce: str) -> str:
    """Where ``learner`` puts its contribution to a round; ``nonce`` has no ``-`` (e.g. hex).

    Raises:
        ValueError: ``nonce`` is empty or holds ``-`` or ``/`` (the key would name another learner).
    """
    if not nonce or "-" in nonce or "/" in nonce:
        raise ValueError(f"contribution nonce {nonce!r} must be non-empty, without '-' or '/'")
    return f"{contribution_round_prefix(run_id, fragment, round_n)}/{learner}-{nonce}{_CONTRIB_SUFFIX}"


def contribution_shard_key(run_id: str, fragment: int, round_n: int, learner: str, nonce: str, rank: int,
                           world: int) -> str:
    """Where rank ``rank`` of a sharded learner group of ``world`` ranks puts its shard of the
    group's contribution ``nonce`` (DESIGN §3.1): ``{learner}-{nonce}.rank{r:03d}of{N:03d}.safetensors``
    beside the whole contributions of the round.

    Raises:
        ValueError: as :func:`contribution_key`, or ``rank`` outside ``[0, world)``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is outside [0, {world})")
    whole = contribution_key(run_id, fragment, round_n, learner, nonce)
    return f"{whole[: -len(_CONTRIB_SUFFIX)]}.rank{rank:03d}of{world:03d}{_CONTRIB_SUFFIX}"


def parse_contribution_key(run_id: str, key: str) -> tuple[int, int] | None:
    """``(fragment, round)`` of a contribution key of ``run_id``; None for any other key."""
    return _parse(_CONTRIB_RE, run_id, key)


def contribution_learner(run_id: str, key: str) -> str | None:
    """The learner whose own prefix holds contribution key ``key`` of ``run_id`` (the name before the
    last ``-`` of ``{learner}-{nonce}.safetensors``; nonces have no ``-``); None for any other key."""
    if parse_contribution_key(run_id, key) is None or not key.endswith(_CONTRIB_SUFFIX):
        return None
    name = key[len(run_id) + 1:].split("/", 3)[3][: -len(_CONTRIB_SUFFIX)]
    learner, sep, nonce = name.rpartition("-")
    return learner if sep and learner and nonce and "/" not in name else None


def versions_prefix(run_id: str) -> str:
    """Every global version of a run lies under this prefix."""
    return f"{run_id}/{_GLOBALS}"


def fragment_versions_prefix(run_id: str, fragment: int) -> str:
    """The global versions of ``fragment`` lie under ``{this}/``."""
    return f"{versions_prefix(run_id)}/p{fragment:03d}"


def version_key(run_id: str, fragment: int, version: int) -> str:
    return f"{fragment_versions_prefix(run_id, fragment)}/v{version:08d}.safetensors"


def parse_version_key(run_id: str, key: str) -> tuple[int, int] | None:
    """``(fragment, version)`` of a global-version key of ``run_id``; None for any other key."""
    return _parse(_VERSION_RE, run_id, key)


def compact_prefix(run_id: str) -> str:
    """Every compact (compressed-download) version of a run lies under this prefix."""
    return f"{run_id}/{_COMPACT}"


def compact_key(run_id: str, fragment: int, version: int, codec: str, mode: str) -> str:
    """The compact payload of ``version`` of ``fragment`` (:mod:`diloco_async.codec.versions`)."""
    return f"{compact_prefix(run_id)}/p{fragment:03d}/v{version:08d}.{mode}-{codec}.safetensors"


def parse_compact_key(run_id: str, key: str) -> tuple[int, int] | None:
    """``(fragment, version)`` of a compact-version key of ``run_id``; None for any other key."""
    return _parse(_COMPACT_RE, run_id, key)


def _parse(pattern: re.Pattern, run_id: str, key: str) -> tuple[int, int] | None:
    if not key.startswith(f"{run_id}/"):
        return None
    m = pattern.match(key[len(run_id) + 1:])
    return None if m is None else (int(m.group(1)), int(m.group(2)))


# -- state folders: checkpoints and inner states ---------------------------------------------


def state_folder(prefix: str, seq: int) -> str:
    """State ``seq`` under ``prefix``: its files lie under ``{this}/``."""
    return f"{prefix}/{seq:08d}"


def state_file_key(prefix: str, seq: int) -> str:
    return f"{state_folder(prefix, seq)}/{_STATE_FILE}"


def state_manifest_key(prefix: str, seq: int) -> str:
    """Written last; a state folder without it does not count."""
    return f"{state_folder(prefix, seq)}/{_MANIFEST}"


def state_seq_of(prefix: str, key: str) -> int | None:
    """The sequence number of the state folder under ``prefix`` that holds ``key``, or None
    (``key`` not under ``prefix``, or not inside a numbered folder)."""
    prefix = prefix.rstrip("/")
    if not key.startswith(f"{prefix}/"):
        return None
    folder, sep, name = key[len(prefix) + 1:].partition("/")
    return int(folder) if folder.isdigit() and sep and name else None


def split_state_key(key: str) -> tuple[str, int]:
    """``(prefix, seq)`` of a state folder ``{prefix}/{seq}`` or of its manifest key.

    Raises:
        ValueError: ``key`` names no state folder.
    """
    parts = key.rstrip("/").split("/")
    if parts[-1] == _MANIFEST:
        parts = parts[:-1]
    if len(parts) < 2 or not parts[-1].isdigit():
        raise ValueError(f"{key!r} names no checkpoint (expected .../{{seq:08d}}[/{_MANIFEST}])")
    return "/".join(parts[:-1]), int(parts[-1])


def checkpoint_prefix(run_id: str) -> str:
    """The synchronizer's checkpoints of a run are state folders under this prefix."""
    return f"{run_id}/{_CHECKPOINTS}"


def checkpoint_state_key(run_id: str, seq: int) -> str:
    return state_file_key(checkpoint_prefix(run_id), seq)


def checkpoint_manifest_key(run_id: str, seq: int) -> str:
    return state_manifest_key(checkpoint_prefix(run_id), seq)


def checkpoint_url(root_url: str, run_id: str, seq: int) -> str:
    """``{root_url}/{run_id}/checkpoints/{seq:08d}``: what :func:`split_checkpoint_url` reads."""
    return f"{root_url}/{state_folder(checkpoint_prefix(run_id), seq)}"


def split_checkpoint_url(url: str) -> tuple[str, str, int | None]:
    """Split ``{root}/{run_id}/checkpoints/{seq}`` (or ``{root}/{run_id}``, meaning the newest
    verified checkpoint) into (root URL, run id, seq or None).

    Raises:
        ValueError: the URL names neither a run nor one of its checkpoints.
    """
    url = url.rstrip("/")
    if url.endswith(f"/{_MANIFEST}"):
        url = url.rsplit("/", 1)[0]
    if f"/{_CHECKPOINTS}/" in url:
        head, seq = url.rsplit(f"/{_CHECKPOINTS}/", 1)
        if not seq.isdigit():
            raise ValueError(f"{url!r}: checkpoint sequence {seq!r} is not a number")
        root, _, run_id = head.rpartition("/")
        return root, run_id, int(seq)
    if url.endswith(f"/{_CHECKPOINTS}"):
        url = url[: -len(f"/{_CHECKPOINTS}")]
    root, _, run_id = url.rpartition("/")
    if not root or not run_id or root.endswith(":/"):
        raise ValueError(f"{url!r} does not name a run ({{root}}/{{run_id}}) or a checkpoint")
    return root, run_id, None


_RUN_MANIFEST = re.compile(r"run-(\d{8})\.json$")


def run_manifest_key(run_id: str, seq: int) -> str:
    """``{run_id}/checkpoints/run-{seq:08d}.json``: run checkpoint ``seq`` of a run with several
    synchronizer shards, naming one checkpoint per shard (diloco_async/storage/run_checkpoints.py)."""
    return f"{checkpoint_prefix(run_id)}/run-{seq:08d}.json"


def run_manifest_seq(run_id: str, key: str) -> int | None:
    """The sequence number of a run manifest key of ``run_id``, or None for any other key."""
    if not key.startswith(f"{checkpoint_prefix(run_id)}/"):
        return None
    m = _RUN_MANIFEST.fullmatch(key[len(checkpoint_prefix(run_id)) + 1:])
    return int(m.group(1)) if m else None


def ddp_checkpoint_prefix(run_id: str) -> str:
    """The data-parallel baseline's checkpoints of a run are state folders under this prefix."""
    return f"{run_id}/ddp/{_CHECKPOINTS}"


def learner_prefix(run_id: str, learner: str) -> str:
    """A learner's own inner states are state folders under this prefix."""
    return f"{run_id}/learners/{learner}"


# -- what one synchronizer process (an epoch) leaves behind ----------------------------------


def summary_key(run_id: str, epoch: str) -> str:
    """Final figures written by one synchronizer process (an epoch) of the run."""
    return f"{run_id}/epochs/{epoch}/summary.json"


def metrics_log_key(run_id: str, epoch: str) -> str:
    return f"{run_id}/epochs/{epoch}/metrics.jsonl"


def final_model_prefix(run_id: str, epoch: str) -> str:
    """The final global model of one epoch as a ``save_pretrained`` folder (``hf`` models): its
    files are the objects under this prefix."""
    return f"{run_id}/epochs/{epoch}/model/"


def merge_log_key(run_id: str, epoch: str) -> str:
    """JSON lines, one per merge: unix time, fragment, round, version, merged update ids."""
    return f"{run_id}/epochs/{epoch}/merges.jsonl"


def contribution_log_key(run_id: str, epoch: str) -> str:
    """JSON lines, one per contribution decided: its round, learner, fate and reason, counters."""
    return f"{run_id}/epochs/{epoch}/contributions.jsonl"


# -- the synchronizer's lease on its run (fencing) -------------------------------------------


def lease_prefix(run_id: str) -> str:
    """Every lease object of a run lies under this prefix: one folder per lease epoch."""
    return f"{run_id}/{_LEASE}"


def lease_claim_key(run_id: str, lease_epoch: int) -> str:
    """Created once (exclusive create) by the synchronizer that takes ``lease_epoch``."""
    return f"{lease_prefix(run_id)}/{lease_epoch:08d}/claim.json"


def lease_renewal_key(run_id: str, lease_epoch: int, k: int) -> str:
    """Renewal ``k`` of lease epoch ``lease_epoch`` (each one a new object; the previous is deleted)."""
    return f"{lease_prefix(run_id)}/{lease_epoch:08d}/renewal-{k:08d}.json"


def lease_released_key(run_id: str, lease_epoch: int) -> str:
    """Written by a synchronizer that stopped cleanly: the lease may be taken at once."""
    return f"{lease_prefix(run_id)}/{lease_epoch:08d}/released.json"


def parse_lease_key(run_id: str, key: str) -> tuple[int, str, int] | None:
    """``(lease_epoch, kind, k)`` of a lease key of ``run_id``: kind ``claim`` (k 0), ``renewal``
    (k its number) or ``released`` (k 0); None for any other key."""
    prefix = f"{lease_prefix(run_id)}/"
    if not key.startswith(prefix):
        return None
    m = _LEASE_RE.match(key[len(prefix):])
    if m is None:
        return None
    kind = m.group(2).partition("-")[0]
    return int(m.group(1)), kind, int(m.group(3) or 0)
