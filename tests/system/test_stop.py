"""Stopping from a terminal: Ctrl-C on `diloco-async train` and `status --watch` in a real
pseudo-terminal (the tty driver SIGINTs the whole foreground process group, as a terminal does),
and a resume that continues every counter the interrupted run printed."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import psutil
import pytest

from diloco_async.client import fetch_status
from storage import keys

from polling import wait_until

pytestmark = [pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STOP_WITHIN_S = 10.0  # the bound: the prompt back this soon after Ctrl-C


class Terminal:
    """A command on a pseudo-terminal of its own (its controlling terminal, its process group in
    the foreground), with everything it prints collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        # setsid --ctty: a new session whose controlling terminal is this pty (stdin)
        self.proc = subprocess.Popen(["setsid", "--ctty", *argv], stdin=slave, stdout=slave, stderr=slave,
                                     env=env, cwd=ROOT)
        os.close(slave)
        self.master = master
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal closed it
                return
            if not data:
                return
            with self._lock:
                self._chunks.append(data)

    def text(self) -> str:
        """Everything printed so far, without colours and cursor moves."""
        with self._lock:
            raw = b"".join(self._chunks)
        return ANSI.sub("", raw.decode(errors="replace")).replace("\r", "")

    def ctrl_c(self) -> float:
        """Type Ctrl-C; returns when (monotonic s)."""
        os.write(self.master, b"\x03")
        return time.monotonic()

    def processes(self) -> list[psutil.Process]:
        """The command and every process under it now."""
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        if self.proc.poll() is None:
            for p in reversed(self.processes()):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait(30)
        self._reader.join(10)
        os.close(self.master)


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _train_overrides(tmp: Path) -> list[str]:
    """A small model that is still training a few seconds in (budget far away)."""
    sets = [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs", "model.n_layer=1", "model.d_model=32",
            "model.n_head=2", "model.context=32", "learners.count=2", "learners.batch_size=8",
            "synchronizer.num_fragments=3", "synchronizer.sync_every=12", "synchronizer.checkpoint_every_s=5",
            "budget.tokens=50000000", "budget.wall_s=300", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db",
            f"tracking.artifact_location={tmp}/art", "tracking.poll_s=1", "tracking.system_metrics_s=0"]
    return [a for s in sets for a in ("--set", s)]


def _command_env(prefect_home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(prefect_home), COLUMNS="160", TERM="xterm-256color")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


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


def _interrupt_training(tmp: Path, env: dict[str, str]) -> tuple[str, dict, float, list[psutil.Process], int]:
    """``train`` in a terminal, Ctrl-C once it merges: (output, status before the Ctrl-C, seconds
    from the Ctrl-C to the exit, every process seen under the command, exit code)."""
    term = Terminal([sys.executable, "-m", "flows.cli", "train", *_train_overrides(tmp)], env)
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
            return st if st["merges"] >= 6 and live == 2 else None

        before = wait_until(merging, 180, "merges with both learners live", interval_s=0.5)
        assert len(seen) >= 4, [p.pid for p in seen.values()]  # the command, sync, 2 learners (+ Prefect's server)
        sent = term.ctrl_c()
        code = term.proc.wait(120)
        took = time.monotonic() - sent
        term._reader.join(10)
        return term.text(), before, took, list(seen.values()), code
    finally:
        term.close()


def _flow_run_states(prefect_home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id").fetchall()


def test_ctrl_c_on_train_stops_within_10_s_and_the_resume_starts_from_every_printed_counter(tmp_path):
    """The temporary Prefect server path (no PREFECT_API_URL), as a newcomer runs it."""
    from diloco_async.sync import open_checkpoint
    from diloco_async.sync.actor import Synchronizer

    text, before, took, seen, code = _interrupt_training(tmp_path, _command_env(tmp_path / "prefect"))
    assert took < STOP_WITHIN_S, f"{took:.1f}s from Ctrl-C to exit:\n{text[-3000:]}"
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "Connection refused" not in text, text
    assert "SIGINT: stopping the run cleanly" in text
    last = [line for line in text.splitlines() if line.strip()][-2:]  # ... and Prefect's "Stopping temporary server"
    assert any(line.startswith("stopped (signal SIGINT) at checkpoint ") for line in last), last
    assert any("prefect.server.api.server:create_app" in " ".join(p.info["cmdline"]) for p in seen)  # its own server
    assert _alive(seen) == []
    assert _flow_run_states(tmp_path / "prefect") == [("train", "COMPLETED")]
    printed = _printed_counters(text)
    assert printed["merges"] >= before["merges"]
    # where a resume starts: the newest checkpoint, restored as `resume` restores it
    url = re.search(r"diloco-async resume (\S+)", "\n".join(last)).group(1)
    cfg, store, run_id, ckpt = open_checkpoint(url, None, [], {})
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
        term = Terminal([sys.executable, "-m", "flows.cli", "status", url, "--watch"],
                        _command_env(tmp_path / "prefect"))
        try:
            deadline = time.monotonic() + 120
            while "open rounds" not in term.text():  # the live tables are on the screen
                assert term.proc.poll() is None, term.text()
                assert time.monotonic() < deadline, term.text()
                await asyncio.sleep(0.1)
            seen = term.processes()
            sent = term.ctrl_c()
            code = await asyncio.to_thread(term.proc.wait, 60)  # the loop serves /status meanwhile
            took = time.monotonic() - sent
            await asyncio.to_thread(term._reader.join, 10)
            text = term.text()
        finally:
            term.close()
    assert took < STOP_WITHIN_S, f"{took:.1f}s:\n{text}"
    assert code == 130
    assert [line for line in text.splitlines() if line.strip()][-1] == "stopped watching (the run goes on)"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert _alive(seen) == []


def test_resume_after_ctrl_c_starts_from_every_counter_the_interrupted_run_printed(prefect_server, tmp_path):
    """The same Ctrl-C against a running Prefect server (PREFECT_API_URL), then a real `resume`."""
    from prefect.settings import PREFECT_API_URL

    env = _command_env(tmp_path / "prefect", PREFECT_API_URL.value())
    text, _before, took, seen, code = _interrupt_training(tmp_path, env)
    assert (code, "Traceback" in text) == (130, False), text[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.1f}s from Ctrl-C to exit"
    assert _alive(seen) == []
    printed = _printed_counters(text)
    url = re.search(r"diloco-async resume (\S+)", text).group(1)
    seq = int(re.search(r"stopped \(signal SIGINT\) at checkpoint (\d+);", text).group(1))
    run_id = url.rsplit("/", 1)[1]
    log = tmp_path / "runs" / run_id / "logs" / "synchronizer.log"
    before_resume = log.read_text()
    # `resume` in a terminal too, and Ctrl-C once its synchronizer has restored the checkpoint
    term = Terminal([sys.executable, "-m", "flows.cli", "resume", url], env)
    try:
        resumed = wait_until(lambda: "resumed counts:" in log.read_text()[len(before_resume):]
                             and log.read_text()[len(before_resume):], 240, "the resumed synchronizer", interval_s=0.2)
        sent = term.ctrl_c()
        code = term.proc.wait(120)
        took = time.monotonic() - sent
        term._reader.join(10)
        again = term.text()
    finally:
        term.close()
    assert (code, "Traceback" in again) == (130, False), again[-3000:]
    assert took < STOP_WITHIN_S, f"resume: {took:.1f}s from Ctrl-C to exit:\n{again[-3000:]}"
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
    # both flow runs ended Completed on the Prefect server they reported to
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        ours = [r for r in client.read_flow_runs(limit=200) if str(tmp_path) in json.dumps(r.parameters)]
        names = {r.flow_id: client.read_flow(r.flow_id).name for r in ours}
    assert sorted((names[r.flow_id], r.state_type.value) for r in ours) == [("resume", "COMPLETED"),
                                                                             ("train", "COMPLETED")]
