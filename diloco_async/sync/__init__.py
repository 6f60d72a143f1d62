"""The synchronizer (DESIGN §2-§5) as a package.

==================  ===================================================================
``actor``           :class:`Synchronizer`: the inbox, dispatch to the components below,
                    learner messages, the clock-driven part
``context``         :class:`ActorContext`: what the actor's components share and none changes
``fragment_book``   :class:`FragmentBook`: the fragments held (the whole plan, or a subset)
``rounds``          :class:`RoundTable`: the open rounds and the global step; schedule and
                    open rounds, admit and verify contributions, quorum, grace, merge and apply
``guard``           :class:`UpdateGuard`: the update guard's memory (norms, directions)
``learners``        the learner registry and goodput ledgers
``reporting``       counters, metric stream, merge log; ``summary``: the summary and status
``checkpoints``     :class:`Checkpointer` and its checkpoint book: starts checkpoints, takes
                    their outcome, collects garbage
``lease``           the run's lease (fencing a second synchronizer), fenced writes, the actor's
                    :class:`Fence`
``lifecycle``       :class:`Phase` and its allowed transitions
``sweeps``          :class:`SweepTimer`: when the parts that look at every live learner run
``stopping``        :class:`StopSequence`: drain, tell the learners, final checkpoint, summary
``state``           fragments, rounds, contributions, internal messages, the push channel
``work``            blocking work run in threads: fetch and verify, merge and publish
``persistence``     initial publish, checkpoint payload, restore (of the components)
``run_resume``      opening the checkpoint a resume of the whole run continues from (a run checkpoint with shards)
``logs``            bounded in-memory logs that spill to local disk; rate-limited log lines
``http``            the aiohttp application in front of the actor
``gate``            credentials and the counters of requests refused at the edge
``snapshot``        the status snapshot the actor publishes for ``/status`` and ``/health``
``process``         :func:`serve` and the command line (``python -m diloco_async.server``)
``tls_setup``       the run's TLS files checked before anything starts; the edge's SSL context
==================  ===================================================================
"""

from diloco_async.sync.actor import Synchronizer
from diloco_async.sync.http import make_app, runner_options
from diloco_async.sync.lifecycle import Phase
from diloco_async.sync.persistence import open_checkpoint, stored_config
from diloco_async.sync.process import STORAGE_OPTIONS_ENV, TOKEN_ENV, main, serve
from diloco_async.sync.run_resume import open_run
from diloco_async.sync.state import Broadcaster, initial_parameters, initial_state, new_run_id
from diloco_async.sync.tls_setup import check_network, learner_tls_env, operator_tls_env

__all__ = [
    "Synchronizer",
    "Broadcaster",
    "Phase",
    "initial_parameters",
    "initial_state",
    "new_run_id",
    "make_app",
    "runner_options",
    "serve",
    "main",
    "open_checkpoint",
    "open_run",
    "stored_config",
    "TOKEN_ENV",
    "STORAGE_OPTIONS_ENV",
    "check_network",
    "learner_tls_env",
    "operator_tls_env",
]
