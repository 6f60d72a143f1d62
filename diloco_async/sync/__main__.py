"""``python -m diloco_async.sync``: the synchronizer process (same as ``python -m diloco_async.server``)."""

from diloco_async.sync.process import main

if __name__ == "__main__":
    raise SystemExit(main())
