"""Stopping from a terminal: Ctrl-C on `diloco-async train` and `status --watch` in a real
pseudo-terminal (the tty driver SIGINTs the whole foreground process group, as a terminal does),
and a resume that continues every counter the interrupted run printed. What each stop leaves is
checked here (exit status 130, no traceback, no process left, the flow runs Completed, every
counter); how soon the prompt is back (the 10 s bound) is a bar of `make bench-kill`
(benchmarks/ctrl_c.py, the median over repeats)."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.ctrl_c import Terminal, command_env, train_overrides
from diloco_async.protocol.client import fetch_status
from diloco_async.storage import keys

from polling import wait_until

pytestmark = [pytest.mark.timeout(400)]

#: how long a stopped command may take before the test fails: a hang, not a slow stop (the 10 s
#: bound on a slow stop is benchmarks/ctrl_c.py's)
EXIT_TIMEOUT_S = 120.0


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _stop(term: Terminal) -> int:
    """Type Ctrl-C; the command's exit status once it exited (a failure when it still runs after
    :data:`EXIT_TIMEOUT_S`)."""
    try:
        return term.stop(EXIT_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {EXIT_TIMEOUT_S:g} s after Ctrl-C:\n{term.text()[-3000:]}")


def _table_value(text: str, row: str) -> str:
    m = re.search(rf"│ {re.escape(row)}\s*│\s*(.+?) │", text)
    assert m, f"no row {row!r} in the summary:\n{text[-3000:]}"
    return m.group(1).strip()


def _printed_counters(text: str) -> dict[str, int]:
    """The counters of the summary table the command printed."""
    merged, late, rejected = (int(x) for x in _table_value(text, "contributions merged / late / rejected").split("/"))
    bytes_in, bytes_out = (int(x) for x in _table_value(text, "bytes in / out").split("/"))
    return {"merges": int(_table_value(text, "merges")), "contributions_merged": merged, "contributions_late": late,
            "contributions_rejected": rejected, "tokens_processed": int(_table_value(text, "tokens processed")),
            "bytes_in": bytes_in, "bytes_out": bytes_out}


#: every figure of the synchronizer's summary that adds up over a run and so must continue across a
#: resume (``wall_s`` and ``uptime`` are figures of one epoch, not of the run)
COUNTERS = ("merges", "contributions_merged", "contributions_late", "contributions_rejected", "rejected_by_reason",
            "bad_requests", "actor_errors", "rounds_abandoned", "rounds_abandoned_by_reason", "clamped_by_reason",
            "contributions_clipped", "contributions_downweighted", "verifications_dropped", "duplicates",
            "bytes_in", "bytes_out", "checkpoints", "global_step", "tokens_processed", "tokens_merged", "useful_s",
            "provisioned_s", "compute_goodput", "token_goodput")


def _counters(summary: dict) -> dict:
    out = {k: summary[k] for k in COUNTERS}
    out["versions"] = {str(p): v for p, v in summary["versions"].items()}
    out["learners"] = {lid: {k: info[k] for k in ("step", "incarnation", "tokens_processed", "tokens_merged",
                                                  "useful_s", "provisioned_s", "contributions")}
                       for lid, info in summary["learners"].items()}
    return out


def _interrupt_training(tmp: Path, env: dict[str, str], overrides: tuple[str, ...] = ()
                        ) -> tuple[str, dict, list[psutil.Process], int]:
    """``train`` in a terminal (with ``--set`` of each of ``overrides`` after the small recipe's),
    Ctrl-C once it has merged with both learners live: (output, status before the Ctrl-C, every
    process seen under the command, exit code)."""
    extra = [a for o in overrides for a in ("--set", o)]
    term = Terminal([sys.executable, "-m", "diloco_async.flows.cli", "train", *train_overrides(tmp), *extra], env)
    try:
        found = wait_until(lambda: re.search(r"synchronizer at (http://127\.0\.0\.1:\d+)", term.text()) or
                           (term.proc.poll() is not None and f"exited {term.proc.returncode}"), 300,
                           "the synchronizer's URL", interval_s=0.2)
        assert not isinstance(found, str), f"train {found} before training:\n{term.text()[-3000:]}"
        url = found.group(1)
        seen: dict[int, psutil.Process] = {}

        def merging() -> dict | None:
            for p in term.processes():
                if p.pid not in seen:
                    try:
                        p.info = {"cmdline": p.cmdline()}
                    except psutil.Error:
                        continue
                    seen[p.pid] = p
            try:
                st = fetch_status(url, timeout_s=10.0)
            except OSError:
                return None
            live = sum(1 for v in st["learners"].values() if v["live"])
            return st if st["merges"] >= 2 and live == 2 else None  # counters that moved: enough to follow

        before = wait_until(merging, 180, "merges with both learners live", interval_s=0.5)
        assert len(seen) >= 4, [p.pid for p in seen.values()]  # the command, sync, 2 learners (+ Prefect's server)
        code = _stop(term)
        return term.text(), before, list(seen.values()), code
    finally:
        term.close()


def _flow_run_states(prefect_home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT f.name, r.state_type, r.state_name FROM flow_run r JOIN flow f ON f.id = r.flow_id"
                          ).fetchall()


def test_ctrl_c_on_train_stops_cleanly_and_the_resume_starts_from_every_printed_counter(tmp_path):
    """The temporary Prefect server path (no PREFECT_API_URL), as a newcomer runs it."""
    from diloco_async.sync import open_checkpoint
    from diloco_async.sync.actor import Synchronizer

    text, before, seen, code = _interrupt_training(tmp_path, command_env(tmp_path / "prefect"))
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "Connection refused" not in text, text
    assert "SIGINT: stopping the run cleanly" in text
    last = [line for line in text.splitlines() if line.strip()][-2:]  # ... and Prefect's "Stopping temporary server"
    assert any(line.startswith("stopped (signal SIGINT) at checkpoint ") for line in last), last
    assert any("prefect.server.api.server:create_app" in " ".join(p.info["cmdline"]) for p in seen)  # its own server
    assert _alive(seen) == []
    # visibly stopped (issue 46 item 3): a Completed state named Stopped, the MLflow run KILLED with its reason
    assert _flow_run_states(tmp_path / "prefect") == [("train", "COMPLETED", "Stopped")]
    from mlflow.tracking import MlflowClient

    mlflow_run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(_table_value(text, "MLflow run"))
    assert (mlflow_run.info.status, mlflow_run.data.tags["diloco.stopped"]) == ("KILLED", "signal SIGINT")
    printed = _printed_counters(text)
    assert printed["merges"] >= before["merges"]
    # where a resume starts: the newest checkpoint, restored as `resume` restores it
    url = re.search(r"diloco-async resume (\S+)", "\n".join(last)).group(1)
    cfg, store, run_id, ckpt = open_checkpoint(url, None, {})
    assert f"at checkpoint {ckpt.seq};" in text
    summary = store.get_json(keys.summary_key(run_id, ckpt.manifest["epoch"]))  # what the summary table showed

    async def restored() -> dict:
        sync = Synchronizer(cfg, store, run_id)
        try:
            await asyncio.to_thread(sync.restore, ckpt)
            return sync.summary()
        finally:
            sync.close()

    start = asyncio.run(restored())
    assert {k: start[k] for k in printed} == printed
    assert _counters(start) == _counters(summary)


async def test_ctrl_c_on_status_watch_in_a_terminal_stops_at_once_with_one_line(tmp_path):
    from test_synchronizer import running, small_config

    async with running(small_config()) as (_sync, client, _store):
        url = str(client.make_url("")).rstrip("/")
        term = Terminal([sys.executable, "-m", "diloco_async.flows.cli", "status", url, "--watch"],
                        command_env(tmp_path / "prefect"))
        try:
            deadline = time.monotonic() + 120
            while "open rounds" not in term.text():  # the live tables are on the screen
                assert term.proc.poll() is None, term.text()
                assert time.monotonic() < deadline, term.text()
                await asyncio.sleep(0.1)
            seen = term.processes()
            code = await asyncio.to_thread(_stop, term)  # the loop serves /status meanwhile
            text = term.text()
        finally:
            term.close()
    assert code == 130, text
    assert [line for line in text.splitlines() if line.strip()][-1] == "stopped watching (the run goes on)"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert _alive(seen) == []


def test_resume_after_ctrl_c_starts_from_every_counter_the_interrupted_run_printed(prefect_server, tmp_path):
    """The same Ctrl-C against a running Prefect server (PREFECT_API_URL), then a real `resume`."""
    from prefect.settings import PREFECT_API_URL

    env = command_env(tmp_path / "prefect", PREFECT_API_URL.value())
    text, _before, seen, code = _interrupt_training(tmp_path, env)
    assert (code, "Traceback" in text) == (130, False), text[-3000:]
    assert _alive(seen) == []
    printed = _printed_counters(text)
    url = re.search(r"diloco-async resume (\S+)", text).group(1)
    seq = int(re.search(r"stopped \(signal SIGINT\) at checkpoint (\d+);", text).group(1))
    run_id = url.rsplit("/", 1)[1]
    log = tmp_path / "runs" / run_id / "logs" / "synchronizer.log"
    before_resume = log.read_text()
    # `resume` in a terminal too, and Ctrl-C once its synchronizer has restored the checkpoint
    term = Terminal([sys.executable, "-m", "diloco_async.flows.cli", "resume", url], env)
    try:
        resumed = wait_until(lambda: "resumed counts:" in log.read_text()[len(before_resume):]
                             and log.read_text()[len(before_resume):], 240, "the resumed synchronizer", interval_s=0.2)
        seen = term.processes()
        code = _stop(term)
        again = term.text()
    finally:
        term.close()
    assert (code, "Traceback" in again) == (130, False), again[-3000:]
    assert _alive(seen) == []
    last = [line for line in again.splitlines() if line.strip()][-2:]
    assert any(line.startswith("stopped (signal SIGINT) at checkpoint ") for line in last), last
    # where the resumed synchronizer started, from its own log
    assert f"resumed run {run_id} from checkpoint {seq}:" in resumed, resumed[-2000:]
    m = re.search(r"resumed counts: merges (\d+), contributions merged/late/rejected (\d+)/(\d+)/(\d+), "
                  r"tokens processed (\d+), bytes in/out (\d+)/(\d+)", resumed)
    assert m, resumed[-2000:]
    start = dict(zip(("merges", "contributions_merged", "contributions_late", "contributions_rejected",
                      "tokens_processed", "bytes_in", "bytes_out"), map(int, m.groups()), strict=True))
    assert start == printed
    after = _printed_counters(again)  # the resumed run's own summary goes on from there
    assert all(after[k] >= printed[k] for k in printed), (after, printed)
    # both flow runs ended Completed, named Stopped, on the Prefect server they reported to
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        ours = [r for r in client.read_flow_runs(limit=200) if str(tmp_path) in json.dumps(r.parameters)]
        names = {r.flow_id: client.read_flow(r.flow_id).name for r in ours}
    assert sorted((names[r.flow_id], r.state_type.value, r.state_name) for r in ours) == [
        ("resume", "COMPLETED", "Stopped"), ("train", "COMPLETED", "Stopped")]
