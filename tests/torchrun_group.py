"""Run a test's 2-rank torchrun group (``torch.distributed.run --standalone``) so that a hang
fails with stacks instead of a bare timeout.

A torchrun group of the tests normally finishes in seconds. Once in a clean-clone CI run one
sat for the whole timeout with no output at all (stop 54), and nothing said where. Now:

* each rank calls :func:`dump_stacks_if_hung` first: past ``HANG_AFTER_S`` its threads' stacks go
  to stderr and it exits (so torchrun fails and reports it);
* the agent (torchrun itself) dumps its stacks on SIGUSR1, which :func:`run_torchrun` sends when the
  group outlives ``timeout_s`` (the agent waits in rendezvous or on its ranks), before killing it;
* the failure message holds the tails of stdout and stderr either way.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

#: seconds after which a rank still running is taken for hung (its stacks printed, exit 1)
HANG_AFTER_S = float(os.environ.get("DILOCO_TEST_HANG_AFTER_S", "200"))

_AGENT = ("import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
          "sys.argv = ['torchrun', *sys.argv[1:]]; runpy.run_module('torch.distributed.run', run_name='__main__')")


def dump_stacks_if_hung() -> None:
    """In a rank: print every thread's stack to stderr and exit if it is still running after HANG_AFTER_S."""
    faulthandler.dump_traceback_later(HANG_AFTER_S, exit=True)


def run_torchrun(script: str | Path, args: list[str], tmp_path: Path, timeout_s: float = 300.0,
                 nproc: int = 2, env: dict[str, str] | None = None, name: str = "torchrun",
                 ) -> subprocess.CompletedProcess:
    """Run ``script args`` on ``nproc`` ranks under torchrun; return the finished process (stdout
    and stderr as text, also kept as ``tmp_path/name.out`` and ``.err``). Fails the test, with both
    streams' tails and the stacks, if it hangs."""
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    cmd = [sys.executable, "-c", _AGENT, "--standalone", "--nproc-per-node", str(nproc), str(script), *args]
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            ranks = psutil.Process(proc.pid).children(recursive=True)  # in sessions of their own
            proc.send_signal(signal.SIGUSR1)  # the agent's stacks
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            for rank in ranks:
                with contextlib.suppress(psutil.Error):
                    rank.kill()
            proc.wait()
            pytest.fail(f"the torchrun group was still running after {timeout_s:.0f} s (its ranks dump their "
                        f"stacks after {HANG_AFTER_S:.0f} s)\n--- stdout\n{out.read_text()[-3000:]}\n"
                        f"--- stderr\n{err.read_text()[-12000:]}")
    return subprocess.CompletedProcess(cmd, rc, out.read_text(), err.read_text())
