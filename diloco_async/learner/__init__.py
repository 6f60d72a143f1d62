"""The learner (DESIGN §3): inner steps that never wait for the network.

* :mod:`~diloco_async.learner.process` — :class:`Learner`, one learner and its two threads;
* :mod:`~diloco_async.learner.training` — the training thread's loop (step boundary, inner steps);
* :mod:`~diloco_async.learner.comms` and :mod:`~diloco_async.learner.uploads` — the comms thread;
* :mod:`~diloco_async.learner.rules` — the outer rules as pure functions (outer gradient, adopt);
* :mod:`~diloco_async.learner.group` — a learner that spans several processes (a torchrun group, DDP);
* :mod:`~diloco_async.learner.faults` — the run's ``[faults]`` (chaos and guard tests), applied once
  where a learner is assembled by wrapping its store, client transport and workload;
* :mod:`~diloco_async.learner.main` — the process entry, ``python -m diloco_async.learner``.

What it trains is a :class:`diloco_async.inner.workload.Workload`.
"""

from diloco_async.learner.main import TIMELINE_DIR_ENV, main
from diloco_async.learner.process import Learner
from diloco_async.learner.state import LearnerSlot, SyncEndpoint

__all__ = ["Learner", "LearnerSlot", "SyncEndpoint", "TIMELINE_DIR_ENV", "main"]
