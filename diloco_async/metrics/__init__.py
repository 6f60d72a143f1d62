"""What a run measures (DESIGN §7, paper §5.1): goodput, timelines and the held-out loss.

:mod:`~diloco_async.metrics.goodput` defines goodput (pure);
:mod:`~diloco_async.metrics.timeline` keeps per-learner timelines and their accounting;
:mod:`~diloco_async.metrics.run_timeline` rebuilds a run's timeline from its records;
:mod:`~diloco_async.metrics.evaluation` evaluates the global model (nats per token, bits per
byte); :mod:`~diloco_async.metrics.heldout_monitor` does it in the background while a run trains.
"""
