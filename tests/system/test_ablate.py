"""`ablate` end to end: the CI suite (2 arms x 2 seeds, real synchronizer and learner processes,
tiny budget) writes its records and its report, and a restarted suite does not re-run finished
(arm, seed) runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from diloco_async.ablation.stats import VERDICTS

ROOT = Path(__file__).resolve().parents[2]
SUITE = "configs/ablations/ci.toml"


def _overrides(tmp: Path) -> list[str]:
    return [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db",
            f"tracking.artifact_location={tmp}/mlartifacts"]


def test_ci_suite_runs_resumes_and_reports(prefect_server, tmp_path):
    from diloco_async.flows.ablate import ablate, record_path

    out = tmp_path / "out"
    first = ablate(suite=SUITE, overrides=_overrides(tmp_path), out=str(out), seeds=[0])  # as if stopped after seed 0
    assert (first["runs_done"], first["runs_skipped"], first["failed"]) == (2, 0, [])
    assert sorted(first["missing"]) == ["mean-s1", "rda-s1"]
    seed0 = {arm: record_path(out, arm, 0).stat().st_mtime_ns for arm in ("mean", "rda")}

    second = ablate(suite=SUITE, overrides=_overrides(tmp_path), out=str(out))  # the restart
    assert (second["runs_done"], second["runs_skipped"], second["failed"], second["missing"]) == (2, 2, [], [])
    assert {arm: record_path(out, arm, 0).stat().st_mtime_ns for arm in ("mean", "rda")} == seed0  # not re-run
    recs = [json.loads(record_path(out, arm, seed).read_text()) for arm in ("mean", "rda") for seed in (0, 1)]
    for r in recs:
        assert r["summary"]["stop_reason"].startswith("token budget reached"), r["summary"]
        assert r["summary"]["tokens_processed"] >= 4096 and 0 < r["figures"]["eval_loss"] < 5.6  # ln 256 = 5.55
        assert r["figures"]["bytes_per_token"] > 0
    assert len({r["run_id"] for r in recs}) == 4

    md = Path(second["report_md"]).read_text()
    table = [line for line in md.splitlines() if line.startswith("| RDA") or line.startswith("| bytes")]
    assert len(table) == 2 and all(any(f"**{v}" in line for v in VERDICTS) for line in table)
    assert [r["verdict"] for r in second["rows"]] and all(r["verdict"] in VERDICTS for r in second["rows"])
    assert all(r["diff_method"] == "paired-t" and r["diff_n"] == 2 for r in second["rows"])
    for png in second["charts"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {Path(p).name for p in second["charts"]} == {"eval_loss.png", "compute_goodput.png", "bytes_per_token.png"}

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for r in recs:
        run = client.get_run(r["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.metrics["ablate/eval_loss"] == r["figures"]["eval_loss"]
        parent = client.get_run(run.data.tags["mlflow.parentRunId"])
        assert parent.info.run_name == "ablate-ci"
    latest = client.get_run(client.get_run(recs[1]["mlflow_run_id"]).data.tags["mlflow.parentRunId"])
    names = {a.path for a in client.list_artifacts(latest.info.run_id)}
    assert {"report.md", "charts", "ablate_rows.json"} <= names


def test_cli_refuses_a_bad_suite_before_starting_anything(tmp_path, monkeypatch, capsys):
    """Exit status 2 with the reason, before anything starts: one case through a fresh interpreter,
    the other in this process (a second interpreter only paid the imports again)."""
    from diloco_async.flows import cli, interrupts

    bad = tmp_path / "bad.toml"
    text = (ROOT / SUITE).read_text().replace('b = "rda"', 'b = "rdaa"', 1)
    bad.write_text(text)
    out = subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "ablate", "--suite", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "names arm 'rdaa'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    arm = tmp_path / "arm.toml"
    arm.write_text((ROOT / SUITE).read_text().replace('"synchronizer.merge=mean"', '"synchronizer.merge=median"'))
    for key, value in cli._ENV_DEFAULTS.items():  # main() sets these in the environment: undone after the test
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(interrupts, "run_flow", lambda *a, **k: pytest.fail(f"not refused: the suite would start {a}"))
    code = cli.main(["ablate", "--suite", str(arm)])
    err = capsys.readouterr().err
    assert code == 2 and "arm 'mean'" in err and "merge" in err, err
