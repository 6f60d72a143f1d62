"""``python -m diloco_async.server``: the synchronizer process (:mod:`diloco_async.sync.process`).

The synchronizer lives in :mod:`diloco_async.sync`; this module keeps the documented command and
re-exports the names imported from here before (``make_app``, ``serve``, ``main``,
``open_checkpoint``, ``TOKEN_ENV``, ``STORAGE_OPTIONS_ENV``).
"""

from diloco_async.sync.http import make_app
from diloco_async.sync.persistence import open_checkpoint
from diloco_async.sync.process import STORAGE_OPTIONS_ENV, TOKEN_ENV, main, serve

__all__ = ["make_app", "serve", "main", "open_checkpoint", "TOKEN_ENV", "STORAGE_OPTIONS_ENV"]

if __name__ == "__main__":
    raise SystemExit(main())
