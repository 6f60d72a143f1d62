"""The Hugging Face Hub: the one child process of a run that may reach it, and the offline lookup
every other process makes.

A run that names a Hub model (``model.hf.pretrained = "org/name"``) or Hub data
(``hf://datasets/...``) has the flow call :func:`download_snapshot` once, before any learner
starts: a child process (``python -m diloco_async.runtime.hub``) runs huggingface_hub's
``snapshot_download`` into ``{cache_dir}/hub`` (huggingface_hub's own cache layout: blobs, a
snapshot folder per commit, ``refs/{revision}``). Every process, the flow included, then finds the
files with :func:`cached_snapshot` (``local_files_only``: no request). Learners run with
``HF_HUB_OFFLINE=1`` as well, so nothing in them can reach the Hub.

The child gets ``HF_HUB_OFFLINE=0`` unless the user set ``HF_HUB_OFFLINE`` before this module was
imported (then the user's value: ``1`` means the cache only). ``HF_ENDPOINT`` and ``HF_TOKEN`` pass
through unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["HUB_SUBDIR", "hub_cache", "cached_snapshot", "download_snapshot", "main"]

HUB_SUBDIR = "hub"
#: the user's own ``HF_HUB_OFFLINE`` (None: unset), read before the library sets its default of 1
USER_HUB_OFFLINE = os.environ.get("HF_HUB_OFFLINE")
DOWNLOAD_TIMEOUT_S = 3600.0


def hub_cache(cache_dir: str | Path) -> Path:
    """Where Hub repositories are cached under a recipe's ``cache_dir``."""
    return Path(cache_dir) / HUB_SUBDIR


def _what(repo_type: str, repo_id: str, revision: str | None) -> str:
    return f"Hub {repo_type} {repo_id!r} (revision {revision or 'main'!r})"


def cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | Path, repo_type: str = "model",
                    allow_patterns: list[str] | None = None) -> Path:
    """The local folder of a Hub repository's snapshot at ``revision`` (default ``main``), found in
    ``{cache_dir}/hub`` without any request.

    Raises:
        FileNotFoundError: it was not downloaded (or only partly); the message names the repository.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision or "main",
                                      cache_dir=hub_cache(cache_dir), local_files_only=True,
                                      allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{_what(repo_type, repo_id, revision)} is not in {hub_cache(cache_dir)}: the train flow downloads it "
            "once before any learner starts (learners never reach the Hub)") from None


def _child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": USER_HUB_OFFLINE if USER_HUB_OFFLINE is not None else "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def download_snapshot(repo_id: str, revision: str | None, cache_dir: str | Path, repo_type: str = "model",
                      allow_patterns: list[str] | None = None, field: str = "model.hf.pretrained",
                      timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download a Hub repository's snapshot into ``{cache_dir}/hub`` (files already there are not
    fetched again) in a child process that may reach the Hub; its local folder.

    Raises:
        ValueError: the Hub has no such repository or revision, or could not be reached, and no
            complete copy is cached; one line naming ``field`` and the repository.
    """
    argv = [sys.executable, "-m", "diloco_async.runtime.hub", repo_id, "--repo-type", repo_type,
            "--revision", revision or "main", "--cache-dir", str(hub_cache(cache_dir))]
    for pattern in allow_patterns or []:
        argv += ["--allow", pattern]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_child_env(), timeout=timeout_s)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        why = lines[-1].removeprefix("error: ") if lines else proc.stderr.strip()[-500:]
        raise ValueError(f"{field}={repo_id!r}: {why}")
    return Path(json.loads(proc.stdout.strip().splitlines()[-1])["folder"])


def _download(args: argparse.Namespace) -> str:
    """Run ``snapshot_download``; one line saying why when it fails (raises SystemExit 2)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = _what(args.repo_type, args.repo_id, args.revision)
    try:
        return snapshot_download(args.repo_id, repo_type=args.repo_type, revision=args.revision,
                                 cache_dir=args.cache_dir, allow_patterns=args.allow or None)
    except GatedRepoError:
        why = f"{what} is gated: accept its terms on the Hub and set HF_TOKEN"
    except RepositoryNotFoundError:
        why = f"{what} does not exist on {constants.ENDPOINT} (or is private: set HF_TOKEN)"
    except RevisionNotFoundError:
        why = f"{what}: no such revision on {constants.ENDPOINT}"
    except LocalEntryNotFoundError as err:
        why = (f"{what} is not cached in {args.cache_dir} and the Hub was not reached "
               f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}): {str(err).splitlines()[0]}")
    except (HfHubHTTPError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else ""
        why = f"{what} could not be downloaded ({type(err).__name__}: {first}) from {constants.ENDPOINT}"
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_async.runtime.hub REPO_ID ...``: download one snapshot, print its folder as JSON."""
    p = argparse.ArgumentParser(prog="python -m diloco_async.runtime.hub")
    p.add_argument("repo_id")
    p.add_argument("--repo-type", default="model", choices=["model", "dataset"])
    p.add_argument("--revision", default="main")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--allow", action="append", default=[], help="allow pattern (repeatable)")
    args = p.parse_args(argv)
    print(json.dumps({"folder": _download(args)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
