"""``diloco-async runs ls STORE [--verify] [--json]``: a store's runs, each with its status, the
newest version of each fragment and its checkpoints with their state (:mod:`diloco_async.storage.runs`; a run
of several synchronizer shards: its run checkpoints, each naming a checkpoint per shard).

Plain text by default: a line per run, then its checkpoints as a table, the one a resume
continues from marked; ``--json``: ``{"store": URL, "runs": [...]}``
(:meth:`diloco_async.storage.runs.RunInfo.to_json`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_runs_parser", "runs_command", "format_runs"]


def add_runs_parser(sub) -> None:
    """Add ``runs ls`` to the ``diloco-async`` subparsers ``sub``."""
    p = sub.add_parser("runs", help="what a store holds: runs, checkpoints and their state")
    verbs = p.add_subparsers(dest="runs_command", required=True)
    ls = verbs.add_parser("ls", help="list a store's runs with their checkpoints (state: verified, unverified, "
                                     "partial, corrupt), newest fragment versions and whether each finished")
    ls.add_argument("store", help="the store root (run.store), e.g. file://.local/store or s3://bucket/prefix")
    ls.add_argument("--verify", action="store_true",
                    help="read every checkpoint's state file and check its size and sha256 (default: only the one "
                         "a resume continues from; the others are 'unverified')")
    ls.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ls.set_defaults(func=runs_command)


def _versions(versions: dict[int, int]) -> str:
    return " ".join(f"p{p}:v{v}" for p, v in versions.items()) or "-"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def format_runs(runs: list, store_url: str) -> str:
    """The plain-text listing of :func:`diloco_async.storage.runs.describe_store`'s ``runs``. A URL is never
    followed by punctuation (a terminal links up to the next space)."""
    if not runs:
        return f"no run (no folder with a config.json) in {store_url}"
    lines = [f"{len(runs)} run(s) in {store_url}"]
    for run in runs:
        reason = f": {run.stop_reason}" if run.stop_reason else ""
        sharded = f", {run.shards} synchronizer shards (run checkpoints)" if run.shards > 1 else ""
        lines += ["", f"{run.run_id}  {run.status}{reason}",
                  f"  fragments {len(run.newest_versions)}, newest versions {_versions(run.newest_versions)}{sharded}"]
        if run.checkpoints:
            rows = [[str(c.seq), c.state, "-" if c.lease_epoch is None else str(c.lease_epoch),
                     "-" if c.global_step is None else str(c.global_step), _versions(c.versions),
                     *([" ".join(f"s{i}:{q}" for i, q in c.shard_seqs.items()) or "-"] if run.shards > 1 else []),
                     "resume" if c.resume else c.detail[:60]] for c in run.checkpoints]
            header = ["checkpoint", "state", "lease", "step", "versions", *(["shards"] if run.shards > 1 else []), ""]
            lines += _table(header, rows)
        else:
            lines.append("  no checkpoint")
        if run.resume_seq is not None and not run.finished:
            lines.append(f"  continue from checkpoint {run.resume_seq} with: diloco-async resume {run.url}")
    return "\n".join(lines)


def runs_command(args: argparse.Namespace) -> int:
    from diloco_async.storage.options import storage_options_from_env
    from diloco_async.storage.runs import describe_store
    from diloco_async.storage.store import ObjectStore

    try:
        store = ObjectStore(args.store, storage_options_from_env())
        root = Path(store.root)
        if store.protocol == "file" and not root.is_dir():  # a typo, not an empty store
            raise FileNotFoundError(f"{root} is a file, not a folder" if root.exists() else f"no folder {root}")
        runs = describe_store(store, verify=args.verify)
    except Exception as err:  # noqa: BLE001 - a missing folder, a bad URL, no credentials (botocore's own errors)
        print(f"error: runs ls {args.store!r}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"store": store.url, "runs": [r.to_json() for r in runs]}, indent=1))
    else:
        print(format_runs(runs, store.url))
    return 0
