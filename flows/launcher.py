"""Re-export shim, for one step: process management moved to :mod:`diloco_async.procs`,
supervision to :mod:`diloco_async.supervisor`, the Prefect launch handles to
:mod:`flows.deployments`. Import from there."""

from diloco_async.procs import (ForkedProcess, ForkServerLauncher, Launcher, LocalProcess, LocalProcessLauncher,
                                ProcessHandle, wait_for_ready_file)
from diloco_async.supervisor import Restart, Supervisor
from flows.deployments import DeploymentLauncher, FlowRunHandle

__all__ = ["ProcessHandle", "Launcher", "LocalProcessLauncher", "ForkServerLauncher", "ForkedProcess",
           "LocalProcess", "wait_for_ready_file", "FlowRunHandle", "DeploymentLauncher", "Supervisor", "Restart"]
