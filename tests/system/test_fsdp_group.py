"""Learner groups sharded with FSDP2 (``learners.parallelism = "fsdp"``, DESIGN §3.1).

* equivalence: a 2-rank FSDP2 group (torchrun, gloo) and a 2-rank DDP group of the same model,
  batch and data, started from the same published version, give the same outer gradient per
  fragment (the FSDP one reassembled from its shard objects by the synchronizer's code, within
  1e-5 relative), and the same parameters after adopting a new version (bit for bit), and after
  one more step (1e-5);
* the FSDP ranks read only their pieces of a version, not the whole object;
* bad input is refused before anything starts, naming the value.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from torchrun_group import dump_stacks_if_hung, run_torchrun

from diloco_async.config.schema import load_config
from diloco_async.inner.workload import Workload
from diloco_async.learner.fsdp_outer import ContributionOrder
from diloco_async.learner.group import LearnerGroup, place_workload
from diloco_async.learner.rules import outer_gradient
from diloco_async.models.transformer import embedding_names
from diloco_async.policy.fragments import plan_fragments, specs_of
from diloco_async.protocol.messages import ShardObject, VersionInfo, shard_list_digest
from diloco_async.protocol.versions import read_version
from diloco_async.storage.store import ObjectRef, ObjectStore
from diloco_async.sync.shard_objects import fetch_shards
from diloco_async.sync.work import put_version

REPO = Path(__file__).resolve().parents[2]
STEPS, FRAGMENTS, RUN = 4, 3, "run-fsdp"


def group_config(parallelism: str, *extra: str):
    return load_config(None, [
        "model.n_layer=2", "model.d_model=48", "model.n_head=2", "model.context=32", "learners.count=1",
        "learners.batch_size=4", "learners.warmup_steps=2", f"synchronizer.num_fragments={FRAGMENTS}",
        "learners.nproc_per_learner=2", f"learners.parallelism=\"{parallelism}\"", "learners.checkpoint_every_s=0",
        f"data.cache_dir=\"{REPO / 'data'}\"", *extra])


def build(parallelism: str) -> tuple[Workload, object]:
    cfg = group_config(parallelism)
    torch.manual_seed(1)
    workload = Workload.from_config(cfg, 0, 0)
    plan = plan_fragments(specs_of({n: p.detach() for n, p in workload.params.items()}), FRAGMENTS,
                          embedding_names(workload.model))
    return workload, plan


def publish(store: ObjectStore, workload: Workload, plan, version: int, seed: int) -> list[dict]:
    """Version ``version`` of every fragment: the model's initial values plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(plan.num_fragments):
        tensors = {n: workload.params[n].detach() + 0.01 * torch.randn(workload.params[n].shape, generator=g)
                   for n in plan.names(p)}
        ref = put_version(store, RUN, p, version, tensors)
        out.append(VersionInfo(fragment=p, version=version, key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256)
                   .model_dump())
    return out


def group_worker(mode: str, store_url: str, versions_path: str, out: str) -> None:
    """One rank of a 2-rank group of ``mode`` (run under torchrun): adopt v0, train, contribute
    every fragment, adopt v1, train one more step."""
    torch.set_num_threads(1)
    group = LearnerGroup.from_env(120.0)
    assert group is not None
    cfg = group_config(mode)
    workload, plan = build(mode)
    place_workload(workload, cfg, 0, group.local_rank)
    store = ObjectStore(store_url)
    listed = json.loads(Path(versions_path).read_text())
    v0, v1 = ([VersionInfo.model_validate(v) for v in listed[k]] for k in ("v0", "v1"))
    group.share_start(workload)
    shapes = {p: {s.name: tuple(s.shape) for s in plan.fragments[p]} for p in range(plan.num_fragments)}

    def adopt_whole(versions: list[VersionInfo]) -> dict[int, dict[str, torch.Tensor]]:
        base = {}
        with torch.no_grad():
            for v in versions:
                base[v.fragment] = read_version(store, ObjectRef(v.key, v.nbytes, v.sha256), shapes[v.fragment])
                for n, t in base[v.fragment].items():
                    workload.params[n].copy_(t)
        return base

    if mode == "fsdp":  # built on the meta device: each rank allocates only its shards, v0 fills them
        assert all(p.is_meta for p in workload.params.values())
        group.shard(workload, cfg, store, "learner-a", plan)
        assert not any(p.is_meta for p in workload.params.values())
        group.start_sharded(RUN, v0)
    else:
        base = adopt_whole(v0)
        group.wrap(workload)
    workload.load_data(cfg, 0)
    for step in range(STEPS):
        workload.step(step)
    if mode == "fsdp":
        orders = [ContributionOrder(p, 1, 0, "fp32", f"u{p}", STEPS, 1, 1.0) for p in range(plan.num_fragments)]
        uploads = group.outer.contribute(orders)
        deltas = {}
        for up in uploads:
            listed_shards = [ShardObject(key=r.key, nbytes=r.nbytes, sha256=r.sha256) for r in up.shards]
            deltas[up.order.fragment] = fetch_shards(store, listed_shards, shard_list_digest(listed_shards), "fp32",
                                                     shapes[up.order.fragment])
        group.outer.adopt(v1)

        def full() -> dict[str, torch.Tensor]:
            return {n: p.full_tensor().detach().clone() for n, p in workload.params.items()}
        read_bytes = group.outer.bytes_read
    else:
        theta = {n: p.detach() for n, p in workload.params.items()}
        deltas = {p: outer_gradient(base[p], {n: theta[n] for n in plan.names(p)}) for p in range(FRAGMENTS)}
        adopt_whole(v1)

        def full() -> dict[str, torch.Tensor]:
            return {n: p.detach().clone() for n, p in workload.params.items()}
        read_bytes = 0
    adopted = full()
    workload.step(STEPS)
    after = full()
    if group.is_leader:
        torch.save({"deltas": deltas, "adopted": adopted, "after": after, "read_bytes": read_bytes}, out)
    group.close()


def run_group(mode: str, tmp_path: Path, store_url: str, versions_path: Path) -> dict:
    out = tmp_path / f"{mode}.pt"
    path = [REPO, REPO / "tests", REPO / "tests" / "system"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = run_torchrun(__file__, ["--group-worker", mode, store_url, str(versions_path), str(out)], tmp_path,
                        timeout_s=600, env=env, name=mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return torch.load(out)


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in b) ** 0.5
    den = sum(float(t.pow(2).sum()) for t in b.values()) ** 0.5
    assert den > 0
    return num / den


def test_fsdp_group_matches_ddp_group(tmp_path):
    store_url = f"file://{tmp_path}/store"
    store = ObjectStore(store_url)
    workload, plan = build("ddp")
    versions = {"v0": publish(store, workload, plan, 0, seed=11), "v1": publish(store, workload, plan, 1, seed=12)}
    versions_path = tmp_path / "versions.json"
    versions_path.write_text(json.dumps(versions))
    ddp = run_group("ddp", tmp_path, store_url, versions_path)
    fsdp = run_group("fsdp", tmp_path, store_url, versions_path)

    assert sorted(fsdp["deltas"]) == sorted(ddp["deltas"]) == list(range(FRAGMENTS))
    for p in range(FRAGMENTS):
        assert set(fsdp["deltas"][p]) == set(plan.names(p))
        rel = relative(fsdp["deltas"][p], ddp["deltas"][p])
        print(f"fragment {p}: outer gradients FSDP2 vs DDP, relative difference {rel:.2e}")
        assert rel < 1e-5, f"fragment {p}: relative difference of the outer gradients {rel:.3e}"
    for n, t in ddp["adopted"].items():
        assert torch.equal(fsdp["adopted"][n], t), f"{n} differs after adopting v1"
    after = relative(fsdp["after"], ddp["after"])
    print(f"parameters one step after adopting v1: relative difference {after:.2e}")
    assert after < 1e-5
    # each version here is one piece (under 4 MiB): rank 0 read each one once, whole; that ranks read
    # less than the whole of a larger one is tests/unit/test_fsdp_shards.py's
    assert fsdp["read_bytes"] == sum(v["nbytes"] for v in versions["v0"] + versions["v1"])


@pytest.mark.parametrize(("overrides", "named"), [
    (['learners.parallelism="fsdp"'], ["parallelism='fsdp'", "nproc_per_learner=1"]),
    (['learners.parallelism="fsdp"', "learners.nproc_per_learner=2", "learners.checkpoint_every_s=0",
      'learners.adopt="mix"'], ["learners.adopt='mix'"]),
    (['learners.parallelism="fsdp"', "learners.nproc_per_learner=2", "learners.checkpoint_every_s=0",
      'synchronizer.download_codec="int8"'], ["synchronizer.download_codec='int8'"]),
    (['learners.parallelism=["ddp", "fsdp"]'], ["learners.parallelism", "'ddp' or 'fsdp'"]),
])
def test_bad_parallelism_is_refused_naming_the_value(overrides, named):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for text in named:
        assert text in str(err.value)


if __name__ == "__main__":
    dump_stacks_if_hung()
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-worker", nargs=4, metavar=("MODE", "STORE", "VERSIONS", "OUT"), required=True)
    group_worker(*ap.parse_args().group_worker)
