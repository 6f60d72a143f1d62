"""The chaos harness end to end, scaled down for CI: real learner processes, a real synchronizer,
DDP ranks on gloo, the seeded fault schedule applied with SIGKILL and restarts, goodput from the
timelines, MLflow runs with the timeline plots. The full scenarios are `make bench-chaos`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from diloco_async.chaos import load_scenario, make_schedule
from diloco_async.chaos.measure import eval_at

ROOT = Path(__file__).resolve().parents[2]
TABLE_KEYS = {"method", "compute_goodput", "token_goodput", "uptime", "eval_loss_equal_time",
              "eval_loss_equal_tokens", "wall_s"}


def _isolated(tmp_path: Path) -> list[str]:
    return [f"run.store=file://{tmp_path}/store", f"run.workdir={tmp_path}/runs",
            f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_location={tmp_path}/art"]


def test_storm_ci_three_methods_one_schedule(prefect_server, tmp_path):
    import matplotlib.image as mpimg

    from flows.chaos import chaos

    scenario = "configs/chaos/storm-ci.toml"
    rows = chaos(scenario=scenario, overrides=_isolated(tmp_path))
    assert [r["method"] for r in rows] == ["ddp", "sync-diloco", "decoupled"]
    by = {r["method"]: r for r in rows}
    sc = load_scenario(scenario)
    planned = make_schedule(sc).availability()
    for r in rows:
        assert TABLE_KEYS <= set(r)
        assert 0.0 <= r["compute_goodput"] <= 1.0 and 0.0 <= r["token_goodput"] <= 1.0
        assert 0.0 <= r["uptime"] <= 1.0 and math.isfinite(r["eval_loss_equal_time"])
        assert r["failures"] == sum(1 for e in make_schedule(sc).events if e.kind == "fail")  # same schedule
        assert r["wall_s"] <= sc.scenario.wall_s + 1
    dec, ddp, syn = by["decoupled"], by["ddp"], by["sync-diloco"]
    # Scaled down (4 slots, a minute, 4 failures), restarts weigh more and DDP is hit less often
    # than in the full storm; the bars (>= 0.9 x availability, >= 3x DDP) are measured on
    # the full scenario by `make bench-chaos`. Here: the same ordering with margins.
    assert dec["compute_goodput"] >= 0.6 * planned
    assert dec["compute_goodput"] >= 2 * ddp["compute_goodput"]
    assert dec["compute_goodput"] > syn["compute_goodput"] + 0.2
    assert dec["eval_loss_equal_time"] < math.log(256) - 1.0  # the global model learned under failures
    # every method is an MLflow run under one parent, with its figures and timeline plot
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for r in rows:
        run = client.get_run(r["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.tags["diloco.chaos.method"] == r["method"]
        assert run.data.metrics["chaos/compute_goodput"] == pytest.approx(r["compute_goodput"])
        # the loss curve of the global model, one point per snapshot, step = tokens in the model
        hist = client.get_metric_history(run.info.run_id, "chaos/eval_loss_by_tokens")
        got = sorted({(int(m.step), m.value) for m in hist})  # identical points are stored once
        want = sorted({(int(c[1]), c[2]) for c in r["eval_curve"]})
        assert [st for st, _ in got] == [st for st, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want])
        assert r["eval_curve"][0][1] == 0 and r["eval_curve"][-1][2] == pytest.approx(r["eval_loss_equal_time"])
        parent = client.get_run(run.data.tags["mlflow.parentRunId"])
        assert parent.info.run_name == "chaos-storm-ci"
        png = client.download_artifacts(run.info.run_id, f"timeline-{r['method']}.png", str(tmp_path))
        img = mpimg.imread(png)
        assert img.shape[0] > 200 and img.shape[1] > 800
        acc = json.loads(Path(client.download_artifacts(run.info.run_id, "goodput_accounting.json",
                                                        str(tmp_path))).read_text())
        assert set(acc["learners"]) == {f"slot-{i}" for i in range(sc.scenario.slots)}
        assert acc["compute_goodput"] == pytest.approx(r["compute_goodput"])
        # every provisioned second is accounted for once
        for a in acc["learners"].values():
            parts = sum(a[k] for k in ("useful_s", "thrown_away_s", "down_s", "starting_s", "restarting_s", "stalled_s",
                                       "blocked_s", "overhead_s"))
            assert parts == pytest.approx(a["provisioned_s"], rel=0.02)
        if r["method"] != "ddp":
            assert sum(a["down_s"] for a in acc["learners"].values()) > 0


def test_eval_at_equal_tokens_interpolates_between_snapshots():
    curve = [(0.0, 0.0, 5.0), (10.0, 100.0, 3.0), (20.0, 200.0, 2.0)]  # (seconds, tokens, loss)
    assert eval_at(curve, 150) == (2.0, pytest.approx(2.5))
    assert eval_at(curve, 100) == (2.0, 3.0)
    assert eval_at(curve, 201) == (2.0, None)  # never reached


def test_straggler_ci_cli_json(tmp_path):
    """K = M waits for the half-speed learner at every round; K = 1 with grace does not."""
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1")
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.cli", "chaos", "--scenario", "configs/chaos/straggler-ci.toml",
           "--json", "--out", str(tmp_path / "straggler.json")]
    for item in _isolated(tmp_path):
        cmd += ["--set", item]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [set(r) for r in rows] == [TABLE_KEYS, TABLE_KEYS]
    by = {r["method"]: r for r in rows}
    # under CI's load Decoupled measured 0.894-0.985 over runs (quiet ~0.93-0.95); the claim is the gap
    assert by["decoupled"]["compute_goodput"] >= 0.85
    assert by["sync-diloco"]["compute_goodput"] <= by["decoupled"]["compute_goodput"] - 0.15
    assert "compute goodput" in out.stderr  # the table goes to stderr when --json is asked
    assert out.stderr.count("mean slot availability") == 1  # the table once, by the CLI (not also by the flow)
    # --out: the full rows, for benchmarks/chaos_bars.py
    doc = json.loads((tmp_path / "straggler.json").read_text())
    assert doc["scenario"] == "straggler-ci" and doc["availability"] == pytest.approx(1.0)
    assert [r["compute_goodput"] for r in doc["rows"]] == [r["compute_goodput"] for r in rows]
    assert all(r["eval_curve"][0][1] == 0 and len(r["eval_curve"]) >= 3 for r in doc["rows"])


def test_chaos_cli_rejects_a_bad_scenario(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[scenario]\nname = "x"\nslots = 2\nwall_s = 5\neval_tokens = 1\n[failures]\nmtbf = 1\n')
    out = subprocess.run([sys.executable, "-m", "flows.cli", "chaos", "--scenario", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "failures.mtbf" in out.stderr
    # methods, overrides and fields the harness owns are refused before anything starts
    for args, why in ((["--methods", "decoupled,dp"], "unknown method dp"),
                      (["--set", "learners.lr=fast"], "learners.lr"),
                      (["--set", "learners.count=7"], "sets learners.count itself"),
                      (["--scenario", "configs/chaos"], "is a directory")):
        cmd = [sys.executable, "-m", "flows.cli", "chaos", "--scenario", "configs/chaos/straggler-ci.toml", *args]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_chaos_bars_ratios_and_exit_status(tmp_path, capsys):
    from benchmarks.chaos_bars import main

    def row(method, cg, eq_tokens, curve=()):
        return {"method": method, "compute_goodput": cg, "eval_loss_equal_tokens": eq_tokens, "eval_curve": list(curve)}

    storm = {"availability": 0.8, "eval_tokens": 150, "rows": [row("ddp", 0.1, None), row("decoupled", 0.76, 2.1)]}
    ff = {"availability": 1.0, "eval_tokens": 150, "rows": [
        row("ddp", 0.6, 2.0, [(0, 0, 5.0), (10, 100, 2.2), (20, 200, 1.8)]), row("decoupled", 0.95, 2.05)]}
    straggler = {"availability": 1.0, "rows": [row("sync-diloco", 0.7, 2.5), row("decoupled", 0.99, 2.4)]}
    paths = []
    for name, doc in (("storm", storm), ("ff", ff), ("straggler", straggler)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"{name}.json"))
    assert main(paths) == 0
    out = capsys.readouterr().out
    # 0.76/0.8 = 0.95; 0.76/0.1 = 7.6; 2.05/2.0 = 1.025; storm 2.1 against DDP's 2.0 at 150 tokens = 1.05
    for figure in ("0.950", "7.600", "1.025", "1.050", "0.990", "0.700"):
        assert figure in out
    assert "MISSED" not in out
    ff["rows"][1]["eval_loss_equal_tokens"] = 2.1  # 5% above DDP: the 3% bar is missed
    (tmp_path / "ff.json").write_text(json.dumps(ff))
    assert main(paths[:2]) == 1
    assert "MISSED" in capsys.readouterr().out


def test_user_overrides_and_methods_for_chaos_and_wan_scenarios():
    """One rule for both harnesses: the user's overrides go after the scenario's, methods keep the
    order given, an unknown method or a field the harness sets is refused."""
    from diloco_async.chaos.scenario import with_user_overrides
    from diloco_async.wan.scenario import load_wan_scenario

    for sc in (load_scenario("configs/chaos/straggler-ci.toml"), load_wan_scenario("configs/wan/wan-ci.toml")):
        out, chosen = with_user_overrides(sc, ["synchronizer.outer_lr=0.5"], ["decoupled", "ddp"])
        assert out.scenario.overrides == [*sc.scenario.overrides, "synchronizer.outer_lr=0.5"]
        assert chosen == ["decoupled", "ddp"] and type(out) is type(sc)
        assert with_user_overrides(sc, None, None) == (sc, list(sc.scenario.methods))
        with pytest.raises(ValueError, match="unknown method 'dp'"):
            with_user_overrides(sc, None, ["dp"])
        with pytest.raises(ValueError, match="learners.count"):
            with_user_overrides(sc, ["learners.count=7"], None)
