"""``python -m diloco_async.server``: the synchronizer process (:func:`diloco_async.sync.main`).

The synchronizer lives in :mod:`diloco_async.sync`; this module is the documented command that
runs it on a host (``--config``, ``--set``, ``--run-id`` or ``--resume``, ``--ready-file``).
"""

from diloco_async.sync import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
