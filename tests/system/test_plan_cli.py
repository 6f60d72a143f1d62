"""`diloco-async plan` as a process (issue 40 item 6): --json for tools, the paper's run beside the
paper's figures, an HF config.json, and bad input refused with exit 2 naming the value. The
formulas and the calibration are tests/unit/test_capacity_plan.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_async.capacity import LearnerSetup, LinkSetup, PlanInputs, SyncSetup, make_plan, shape_from_count

ROOT = Path(__file__).resolve().parents[2]


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # the timeout is the failure mode only


def test_json_is_the_librarys_plan():
    proc = _plan("--json", "--params", "12B", "--learners", "8", "--devices-per-learner", "64", "--parallelism",
                 "fsdp", "--device", "gpu", "--regions", "4", "--link-gbps", "2,3,4,5", "--codec", "int4",
                 "--download-codec", "int4", "--sync-every", "24", "--fragments", "24", "--overlap", "2",
                 "--shards", "3", "--step-s", "2.5", "--budget-tokens", "1e12")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = make_plan(PlanInputs(
        model=shape_from_count(12_000_000_000),
        learners=LearnerSetup(count=8, devices=64, parallelism="fsdp", accelerator=True, batch_per_rank=16,
                              context=64, step_s=2.5),
        sync=SyncSetup(sync_every=24, fragments=24, overlap=2, shards=3, codec="int4", download_codec="int4"),
        links=LinkSetup(regions=4, gbps=(2.0, 3.0, 4.0, 5.0)), budget_tokens=10**12)).to_json()
    assert got == json.loads(json.dumps(want))
    assert got["synchronizer_shard"]["host_bytes"] > 0 and len(got["shards"]) == 3
    assert [link["rate_gbps"] for link in got["links"]] == [2.0, 3.0, 4.0, 5.0]
    assert got["speedup"] > 1


def test_the_papers_run_prints_beside_the_papers_figures():
    proc = _plan("--paper")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    ddp = next(x for x in lines if x.startswith("DDP all-reduce"))
    assert "198 Gb" in ddp and "198 (the anchor)" in ddp
    for codec in ("bf16", "int4"):
        rate = next(x for x in lines if x.startswith(f"Decoupled DiLoCo, {codec}"))
        assert rate.rstrip().endswith("0.84")
        assert next(x for x in lines if x.startswith(f"DDP / Decoupled DiLoCo rate, {codec}")).rstrip().endswith("236")
    speedups = [x for x in lines if x.startswith("speed-up over DDP")]
    assert len(speedups) == 4 and all(x.rstrip().endswith("> 20") for x in speedups)
    as_json = json.loads(_plan("--paper", "--json").stdout)
    rows = {r["figure"]: r for r in as_json["rows"]}
    assert rows["Decoupled DiLoCo, int4 both ways: link rate (mean)"]["paper"] == "0.84"
    predicted = f"{rows['Decoupled DiLoCo, int4 both ways: link rate (mean)']['predicted']:.3g}"
    assert any(x.startswith("Decoupled DiLoCo, int4") and predicted in x for x in lines)


def test_an_hf_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 2048,
        "torch_dtype": "bfloat16", "transformers_version": "4.0"}))
    proc = _plan("--hf-config", str(tmp_path), "--fragments", "4", "--step-s", "0.2", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    model = got["inputs"]["model"]
    assert model["gated_mlp"] and model["n_layer"] == 2 and model["tensors"] > 4
    assert any(p["name"] == "activations" for p in got["learner_rank"]["parts"])


def test_the_default_recipe_prints_a_plan_and_asks_for_a_step_time():
    proc = _plan()
    assert proc.returncode == 0, proc.stderr
    assert "learner rank 0" in proc.stdout and "synchronizer shard" in proc.stdout
    assert "give --step-s" in proc.stdout


@pytest.mark.parametrize("args, named", [
    (["--learners", "-3"], "learners=-3"),
    (["--shards", "9"], "shards (S)=9 exceeds fragments (P)=4"),
    (["--codec", "int3"], "codec='int3'"),
    (["--params=-12B"], "params=-12000000000"),
    (["--params", "twelve"], "'twelve' is not a count"),
    (["--regions", "2", "--link-gbps", "1,2,3"], "link_gbps has 3 rates"),
    (["--link-gbps", "fast"], "--link-gbps 'fast'"),
    (["--hf-config", "/nonexistent/config.json"], "/nonexistent/config.json"),
    (["--recipe", "no-such-recipe"], "no-such-recipe"),
])
def test_bad_input_exits_2_naming_the_value(args, named):
    proc = _plan(*args)
    assert proc.returncode == 2 and named in proc.stderr, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
