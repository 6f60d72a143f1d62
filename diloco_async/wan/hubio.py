"""Store work that must happen inside the hub namespace: the hub (and its S3 server) is reachable
from the regions only, not from the namespace the harness itself runs in. The file system is
shared by every namespace, so a process started in the hub creates the run's bucket and, after a
method's run, copies the run's objects to a local folder the harness then reads as ``file://``.

Usage (inside the hub: ``ip netns exec HUB python -m diloco_async.wan.hubio ...``)::

    python -m diloco_async.wan.hubio mkdir ENDPOINT_URL BUCKET
    python -m diloco_async.wan.hubio mirror ENDPOINT_URL BUCKET/PREFIX DEST_DIR

Exit status 0 on success, 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["hub_mkdir", "hub_mirror", "main"]


def _fs(endpoint_url: str):
    import fsspec

    return fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint_url})


def _in_hub(net, argv: list[str], timeout_s: float) -> None:
    """Run ``python -m diloco_async.wan.hubio argv...`` in the hub namespace.

    Raises:
        RuntimeError: it failed (with its stderr).
    """
    cmd = net.exec_argv(net.hub_ns, [sys.executable, "-m", "diloco_async.wan.hubio", *argv])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"hub store {argv[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def hub_mkdir(net, endpoint_url: str, bucket: str) -> None:
    """Create ``bucket`` on the S3 server in ``net``'s hub (RuntimeError when it fails)."""
    _in_hub(net, ["mkdir", endpoint_url, bucket], 120.0)


def hub_mirror(net, endpoint_url: str, src: str, dest: Path) -> Path:
    """Copy every object under ``src`` (``bucket/prefix``) of the hub's S3 server to ``dest``
    (same relative keys); returns ``dest``. RuntimeError when it fails."""
    _in_hub(net, ["mirror", endpoint_url, src, str(Path(dest).resolve())], 600.0)
    return Path(dest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) == 3 and argv[0] == "mkdir":
            _fs(argv[1]).mkdir(argv[2])
        elif len(argv) == 4 and argv[0] == "mirror":
            fs, src, dest = _fs(argv[1]), argv[2].rstrip("/"), Path(argv[3])
            for key in fs.find(src):
                out = dest / key[len(src) + 1:]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(fs.cat_file(key))
        else:
            print(__doc__.strip().split("Usage", 1)[1], file=sys.stderr)
            return 2
    except Exception as err:  # the reason goes to the caller
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
