"""The terminal commands an operator types, driven as a user would: output to a pipe, Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
from test_synchronizer import running, small_config


async def _read_until(stream: asyncio.StreamReader, needle: str, count: int, timeout_s: float) -> str:
    text = ""
    deadline = time.monotonic() + timeout_s
    while text.count(needle) < count:
        chunk = await asyncio.wait_for(stream.read(4096), max(0.1, deadline - time.monotonic()))
        assert chunk, f"output ended before {count} x {needle!r}:\n{text}"
        text += chunk.decode(errors="replace")
    return text


# a background job of a non-interactive shell starts with SIGINT ignored (and so do make test's
# workers when make itself was started that way): Ctrl-C must stop watching all the same
_SIGINT_IGNORED = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh"]


@pytest.mark.parametrize(("signum", "exit_code", "prefix"), [(signal.SIGINT, 130, []), (signal.SIGTERM, 143, []),
                                                             (signal.SIGINT, 130, _SIGINT_IGNORED)],
                         ids=["ctrl-c", "sigterm", "ctrl-c-when-started-with-sigint-ignored"])
async def test_status_watch_to_a_pipe_prints_each_refresh_and_stops_cleanly_on_ctrl_c(signum, exit_code, prefix):
    async with running(small_config()) as (_sync, client, _store):
        url = str(client.make_url("")).rstrip("/")
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "diloco_async.flows.cli", "status", url, "--watch",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "COLUMNS": "160"})
        try:
            # not a terminal: one table per refresh (2 s apart), not a single one at exit
            text = await _read_until(proc.stdout, "open rounds", 2, timeout_s=60)
            proc.send_signal(signum)
            # a watch that ignored the signal would go on refreshing: these 60 s are the failure mode
            rest = (await asyncio.wait_for(proc.stdout.read(), 60)).decode(errors="replace")
            code = await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert code == exit_code  # the signal's own code: the watch stopped on it
        assert "stopped watching" in rest
        assert "rejected by reason" in text and "budget" in text and "last heard" in text
        assert "Traceback" not in text + rest and "KeyboardInterrupt" not in text + rest


def test_version_and_top_level_help_speak_to_a_user(capsys):
    import pytest

    from diloco_async.flows.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("diloco-async ") and out.split()[1][0].isdigit()
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Decoupled DiLoCo" in out and "examples:" in out
    assert "``" not in out and "import lazily" not in out  # no internal docstring markup


def test_prefect_sees_the_embedded_defaults_whatever_the_subcommand_imports():
    """Prefect reads its settings once, at import: the CLI sets its defaults (a 120 s startup timeout
    for the temporary server) before a subcommand imports a flow module."""
    import subprocess

    probe = ("import sys; from diloco_async.flows.cli import main; main(['recipes']); import diloco_async.flows.train; "
             "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s; print(s.value())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_EPHEMERAL")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "120"
