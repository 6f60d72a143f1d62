"""Inner-state checkpoints of a learner group sharded with FSDP2 (DCP, DESIGN §3.1).

A 2-rank FSDP2 group (torchrun, gloo) adopts a published version, trains, and saves its inner
state through ``torch.distributed.checkpoint`` (one writer per rank, into a ``file://`` store,
manifest last); a new 2-rank group restores it: parameters, both AdamW moments, AdamW's step,
the base copies and the sampler's generator come back bit for bit, each rank fetches only the
files its load plan reads, and the next step of the restored group equals the next step of the
group that saved. A group of another size is refused, naming both sizes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from test_fsdp_group import FRAGMENTS, RUN, group_config, publish
from torch.distributed.tensor import DTensor, Shard
from torchrun_group import dump_stacks_if_hung, run_torchrun

from diloco_async.inner.state import state_meta
from diloco_async.inner.workload import Workload
from diloco_async.learner.fsdp_state import check_world, latest_sharded_state, save_sharded_state
from diloco_async.learner.group import LearnerGroup, place_workload
from diloco_async.models import plan_of
from diloco_async.protocol.messages import VersionInfo
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

REPO = Path(__file__).resolve().parents[2]
LEARNER, STEPS = "learner-a", 3
#: byte-GPT (built on the meta device, only its shards allocated) and a 2-layer Llama (built on the
#: CPU: it has buffers; its decoder layers are the units)
MODELS = {"byte-gpt": [], "llama": ['model.kind="hf"', 'model.hf.architecture="llama"',
                                    "model.hf.config={hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
                                    "num_attention_heads=4, num_key_value_heads=2}"]}


def build(parallelism: str, model: str):
    cfg = group_config(parallelism, *MODELS[model])
    torch.manual_seed(1)
    workload = Workload.from_config(cfg, 0, 0)
    return cfg, workload, plan_of(workload.model, FRAGMENTS)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(group: LearnerGroup, workload) -> dict:
    """Every rank's state made whole (collectives: every rank calls it)."""
    outer = group.outer
    mesh = next(iter(workload.params.values())).device_mesh
    out = {"param": {n: _full(p) for n, p in workload.params.items()}, "rng": workload.generator.get_state()}
    for key in ("exp_avg", "exp_avg_sq", "step"):
        out[key] = {n: _full(workload.optimizer.state[p][key]) for n, p in workload.params.items()}
    out["base"] = {f"{p}/{n}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False,
                                                   shape=torch.Size(outer.shapes[p][n]),
                                                   stride=torch.empty(outer.shapes[p][n]).stride()).full_tensor()
                   for p, tensors in outer.base.items() for n, t in tensors.items()}
    return out


def state_worker(mode: str, model: str, store_url: str, versions_path: str, out: str) -> None:
    """One rank of a 2-rank FSDP2 group of ``model``: ``save`` adopts v0, trains and saves; ``load`` restores."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    group = LearnerGroup.from_env(120.0)
    assert group is not None
    cfg, workload, plan = build("fsdp", model)
    place_workload(workload, cfg, 0, group.local_rank)
    store = ObjectStore(store_url)
    v0 = [VersionInfo.model_validate(v) for v in json.loads(Path(versions_path).read_text())["v0"]]
    group.share_start(workload)
    group.shard(workload, cfg, store, LEARNER, plan)
    prefix = keys.learner_prefix(RUN, LEARNER)
    if mode == "save":
        group.start_sharded(RUN, v0)
        workload.load_data(cfg, 0)
        for step in range(STEPS):
            workload.step(step)
        meta = state_meta(STEPS, {v.fragment: v.version for v in v0}, {0: (STEPS, 123, 1.5)})
        save_sharded_state(store, prefix, 1, workload, group.outer, meta, LEARNER)
    else:
        saved = latest_sharded_state(store, prefix) if group.is_leader else None
        assert group.start_sharded(RUN, v0, saved, workload) is not None
        workload.load_data(cfg, 0)
    state = snapshot(group, workload)
    workload.step(STEPS)
    after = {n: _full(p) for n, p in workload.params.items()}
    if group.is_leader:
        torch.save({"state": state, "after": after}, out)
    group.close()


def run_group(mode: str, model: str, tmp_path: Path, store_url: str, versions_path: Path) -> dict:
    out = tmp_path / f"{mode}.pt"
    path = [REPO, REPO / "tests", REPO / "tests" / "system"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = run_torchrun(__file__, ["--state-worker", mode, model, store_url, str(versions_path), str(out)], tmp_path,
                        timeout_s=600, env=env, name=mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return {**torch.load(out), "log": proc.stderr}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_sharded_inner_state_restores_bit_for_bit(tmp_path, model):
    store_url = f"file://{tmp_path}/store"
    store = ObjectStore(store_url)
    _, workload, plan = build("ddp", model)
    versions_path = tmp_path / "versions.json"
    versions_path.write_text(json.dumps({"v0": publish(store, workload, plan, 0, seed=11)}))
    saved = run_group("save", model, tmp_path, store_url, versions_path)
    manifest = latest_sharded_state(store, keys.learner_prefix(RUN, LEARNER))
    assert manifest is not None and manifest["world"] == 2 and manifest["inner"]["step"] == STEPS
    assert set(manifest["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "replicated.pt"}
    restored = run_group("load", model, tmp_path, store_url, versions_path)

    a, b = saved["state"], restored["state"]
    assert set(a) == set(b) == {"param", "exp_avg", "exp_avg_sq", "step", "base", "rng"}
    assert torch.equal(a["rng"], b["rng"])
    for kind in ("param", "exp_avg", "exp_avg_sq", "step", "base"):
        assert set(a[kind]) == set(b[kind]) and a[kind], kind
        for n, t in a[kind].items():
            assert torch.equal(t, b[kind][n]), f"{kind} {n} differs after the restore"
    assert any(float(t.abs().sum()) > 0 for t in a["exp_avg"].values())  # the moments were not left at zero
    for n, t in saved["after"].items():  # the next step of the restored group is the saving group's
        assert torch.equal(t, restored["after"][n]), f"{n} differs one step after the restore"
    for rank in (0, 1):
        assert f"rank {rank} restored sharded inner state 1" in restored["log"]
    fetched = sorted(line.split("(fetched ")[1] for line in restored["log"].splitlines() if "(fetched " in line)
    print("fetched by the restoring ranks:", fetched)  # each rank its own shards, never the other's
    assert fetched == [f"['.metadata', '__{r}_0.distcp', 'replicated.pt'])" for r in (0, 1)]


def test_a_state_saved_by_another_group_size_is_refused_naming_both():
    with pytest.raises(ValueError) as err:
        check_world({"world": 2, "seq": 7}, 4, "run/learners/learner-0")
    assert "saved by a group of 2 ranks; this group has 4" in str(err.value)
    assert "run/learners/learner-0" in str(err.value) and "state 7" in str(err.value)
    check_world({"world": 2, "seq": 7}, 2, "x")  # the same size passes


if __name__ == "__main__":
    dump_stacks_if_hung()
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-worker", nargs=5, metavar=("MODE", "MODEL", "STORE", "VERSIONS", "OUT"), required=True)
    state_worker(*ap.parse_args().state_worker)
