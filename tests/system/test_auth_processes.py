"""Per-learner credentials with real processes (issue 14, item 2; defect 10): a learner token acts
only as its learner against a synchronizer process, and the learner processes a run starts get
only their own token (the HTTP side is tests/contract/test_auth.py's)."""

from __future__ import annotations

import aiohttp
import pytest
from test_auth import RUN, SECRET, CountingQueue, Server, serving, token  # noqa: F401, F811 (shared with contract/test_auth.py; fixtures among them)
from test_synchronizer import small_config

from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
from diloco_async.runtime.procs import LocalProcessLauncher

from polling import await_until

pytestmark = pytest.mark.timeout(120)


# -- defect 10: one shared token ------------------------------------------------------------


async def test_a_learner_token_acts_only_as_that_learner():
    async with serving(small_config()) as srv:
        for lid in ("a", "b"):
            code, answer = await srv.call("POST", "/join", {"learner_id": lid}, token(lid))
            assert code == 200, answer
        code, answer = await srv.call("POST", "/heartbeat", {"learner_id": "a", "step": 1}, token("a"))
        assert code == 200 and answer["known"], answer
        # a's token as b: join, heartbeat, evicting b by a higher incarnation
        for path, body in (("/join", {"learner_id": "b"}), ("/join", {"learner_id": "b", "incarnation": 7}),
                           ("/heartbeat", {"learner_id": "b", "step": 3})):
            code, answer = await srv.call("POST", path, body, token("a"))
            assert (code, answer["reason"]) == (403, "forbidden"), (path, answer)
        # nor b's push channel, nor the operator's routes
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await srv.session.ws_connect(f"{srv.url}/ws?learner_id=b",
                                         headers={"Authorization": f"Bearer {token('a')}"})
        assert err.value.status == 403
        assert (await srv.call("POST", "/checkpoint", {}, token("a")))[0] == 403
        assert (await srv.call("GET", "/metrics", None, token("a")))[0] == 403
        # a token of no learner of this run (another run's, or made up) is unauthenticated
        code, answer = await srv.call("POST", "/join", {"learner_id": "b"}, learner_token(SECRET, "run2", "b"))
        assert (code, answer["reason"]) == (401, "unauthenticated")
        async def b_listed():  # /status is a snapshot the actor publishes: it may lag the join a little
            st = await srv.status()
            return st if "b" in st["learners"] else None

        st = await await_until(b_listed, 60, "learner b in /status")
        assert st["learners"]["b"]["incarnation"] == 0 and st["learners"]["b"]["live"]  # b was not evicted
        assert st["rejected_by_reason"] == {"forbidden": 6, "unauthenticated": 1}
        # b itself may rejoin with a higher incarnation; the run secret may act as anyone
        assert (await srv.call("POST", "/join", {"learner_id": "b", "incarnation": 1}, token("b")))[0] == 200
        assert (await srv.call("POST", "/heartbeat", {"learner_id": "a", "step": 2}, SECRET))[0] == 200
        async def b_rejoined():  # the rejoin, like the first join, reaches /status with the next snapshot
            return (await srv.status())["learners"]["b"]["incarnation"] == 1

        await await_until(b_rejoined, 60, "b's incarnation 1 in /status")


# -- who holds which credential ---------------------------------------------------------------


def test_learner_processes_get_only_their_own_token(tmp_path, monkeypatch):
    from diloco_async.run import RunProcesses

    monkeypatch.setenv(TOKEN_ENV, SECRET)  # the operator's secret, in the flow's environment
    cfg = small_config(**{"run.workdir": str(tmp_path), "run.store": f"file://{tmp_path}/store"})
    run = RunProcesses(cfg, run_id="r9")
    assert run.token == SECRET
    env = run.learner_env("learner-1")
    assert env[LEARNER_TOKEN_ENV] == learner_token(SECRET, "r9", "learner-1") and TOKEN_ENV not in env
    # a process started by hand never inherits the run secret from the environment
    launcher = LocalProcessLauncher(tmp_path / "logs")
    code = f"import os; print(os.environ.get({TOKEN_ENV!r}), os.environ.get({LEARNER_TOKEN_ENV!r}))"
    child = launcher.start("probe", ["-c", code], {LEARNER_TOKEN_ENV: "mine"})
    assert child.proc.wait(timeout=30) == 0
    assert (tmp_path / "logs" / "probe.log").read_text().split() == ["None", "mine"]
