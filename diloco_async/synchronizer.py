"""Re-exports of :mod:`diloco_async.sync` under the module path used before it became a package
(``Synchronizer``, ``Broadcaster``, ``initial_parameters``, ``new_run_id``)."""

from diloco_async.sync.actor import Synchronizer
from diloco_async.sync.state import Broadcaster, initial_parameters, new_run_id

__all__ = ["Synchronizer", "Broadcaster", "initial_parameters", "new_run_id"]
