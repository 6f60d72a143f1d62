"""`diloco-async wan --scenario configs/wan/wan-ci.toml --json` over real namespaces and shaped links
(issue 13): one JSON object per method with the verified link rates, and nothing left behind.
Needs root, `ip` and `tc` with tbf (CI runs as root); skipped with the harness's reason otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_async.wan.netns import root_reason
from diloco_async.wan.slot_link import LINK_REGION
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
_WHY = root_reason()


def _names(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix)]


def _left_by_this_run(before: set[str]) -> set[str]:
    """Namespaces made since ``before`` that are not another test's: a chaos slot link's net
    (``<tag>-hub``, ``<tag>-link``, made by a heterogeneous-fleet test on the other xdist worker)
    is excluded by its ``-link`` namespace; a net torn down region first leaves its hub a moment
    longer, so the caller polls."""
    new = set(_names("dlw")) - before
    others = {n.rsplit("-", 1)[0] for n in new if n.endswith(f"-{LINK_REGION}")}
    return {n for n in new if n.rsplit("-", 1)[0] not in others}


@pytest.mark.skipif(_WHY is not None, reason=f"the WAN harness cannot run here: {_WHY}")
def test_wan_json_on_the_ci_scenario(prefect_server, tmp_path):
    """Against the session's Prefect server (a temporary one per command is test_stop's newcomer path)."""
    from prefect.settings import PREFECT_API_URL

    before = set(_names("dlw"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_API_URL": PREFECT_API_URL.value()}
    sets = [f"run.workdir={tmp_path}/runs", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/mlartifacts"]
    argv = [sys.executable, "-m", "diloco_async.flows.cli", "wan", "--scenario", "configs/wan/wan-ci.toml", "--json",
            "--out", str(tmp_path / "report.json"), *[x for s in sets for x in ("--set", s)]]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["method"] for r in rows] == ["ddp", "decoupled"]
    for r in rows:
        assert set(r) == {"method", "time_to_target_s", "bytes_per_token", "eval_loss_equal_tokens", "link_rates"}
        assert sorted(r["link_rates"]) == ["r0", "r1"]
        for rate in r["link_rates"].values():
            assert rate["up_mbit_set"] == rate["down_mbit_set"] == 20.0
            for d in ("up", "down"):
                assert abs(rate[f"{d}_mbit_measured"] / 20.0 - 1) <= 0.15
    ddp, dec = rows
    # DDP's all-reduce: 2 (N-1)/N x fp32 bytes up and down per step of 2 x 16 x 64 tokens, plus TCP/IP headers
    report = json.loads((tmp_path / "report.json").read_text())
    ring = report["ddp_ring_bytes_per_token"]
    assert ring == pytest.approx(2 * 1_751_040 / 1024)
    assert ring <= ddp["bytes_per_token"] <= 1.2 * ring
    assert ddp["time_to_target_s"] is not None and ddp["eval_loss_equal_tokens"] is not None
    assert 0 < dec["bytes_per_token"] < ddp["bytes_per_token"] / 4
    # links.delay_ms = 5: every learner adds it per exchange, every DDP all-reduce 2 (2 - 1) x 2 x 5 ms
    logs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "runs").glob("*/logs/*.log"))
    assert "learner-0: link latency 5.0 ms one way" in logs and "learner-1: link latency 5.0 ms one way" in logs
    assert "rank 1: 20.0 ms of link latency added to every all-reduce" in logs
    # this run's namespaces (and their veths and qdiscs) are gone; another test's may come and go meanwhile
    wait_until(lambda: not _left_by_this_run(before), 60.0, "no namespace of this run's left")
