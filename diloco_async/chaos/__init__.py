"""The chaos harness (DESIGN §8): one seeded fault schedule, applied in real time to the real
processes of each method, and the goodput and held-out loss each method achieved under it.

* :mod:`~diloco_async.chaos.scenario`: scenario files and their seeded fault schedules (pure);
* :mod:`~diloco_async.chaos.driver`: applies a schedule to a target in real time, and the
  bookkeeping of each slot's down and stalled intervals;
* :mod:`~diloco_async.chaos.targets`: one target per method: the DiLoCo learners and their
  synchronizer (``sync-diloco``, ``decoupled``), the DDP ranks (``ddp``); each gives a timeline
  and the snapshots of its global model;
* :mod:`~diloco_async.chaos.measure`: goodput from a timeline, held-out loss of the snapshots.

Hostile and crash testing of one run (issue 14):

* :mod:`~diloco_async.chaos.fuzz`: a seeded generator of valid, boundary and hostile API requests (pure);
* :mod:`~diloco_async.chaos.scripted`: honest scripted learners and a poisoner, protocol clients without a model;
* :mod:`~diloco_async.chaos.fuzz_run`: the API fuzz against a live synchronizer process;
* :mod:`~diloco_async.chaos.kill_matrix`: SIGKILL of learners (some mid-upload) and of the synchronizer
  followed by resume, on a real run, and the checks of what the store holds afterwards.

The Prefect flow, MLflow logging and the table are ``diloco_async/flows/chaos.py``. Importing this package
loads only the scenario module (the command line validates a scenario without torch).
"""

from diloco_async.chaos.scenario import (
                                         METHODS,
                                         FaultEvent,
                                         Scenario,
                                         Schedule,
                                         check_user_overrides,
                                         harness_fields,
                                         load_scenario,
                                         make_schedule,
                                         method_config,
)

__all__ = ["METHODS", "Scenario", "FaultEvent", "Schedule", "load_scenario", "make_schedule", "method_config",
           "harness_fields", "check_user_overrides"]
