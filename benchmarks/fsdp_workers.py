"""The ranks of ``make bench-fsdp`` (:mod:`benchmarks.fsdp_bars`), each run under torchrun (gloo, CPU).

* ``memory``: one sharded learner's life once, on the real code: the model built on the meta
  device and sharded (FSDP2), each rank's rows of v0 read and adopted, ``--steps`` inner steps,
  every fragment's outer gradient shard put, v1 adopted (a fragment at a time, as a run's
  versions arrive), the inner state saved (DCP). Each rank
  writes its RSS after ``import torch``, joining the group and one tiny inner step (the baseline,
  as :mod:`benchmarks.memory` takes it) and its peak RSS
  (``ru_maxrss``) after each phase.
* ``plain``: the same group's inner steps alone (no synchronizer, no outer loop), after adopting
  v0; rank 0 writes tokens/s over the timed steps.

Usage (by :mod:`benchmarks.fsdp_bars`): ``torchrun --nproc-per-node 2 -m benchmarks.fsdp_workers
MODE SPEC_JSON OUT``, SPEC_JSON naming the resolved config, the store, the published versions
and the phase lengths.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import psutil
import torch

from diloco_async.config.schema import Config, ModelConfig
from diloco_async.inner.state import state_meta
from diloco_async.inner.workload import Workload, inner_step
from diloco_async.learner.fsdp_outer import ContributionOrder
from diloco_async.learner.fsdp_state import save_sharded_state
from diloco_async.learner.group import LearnerGroup, place_workload
from diloco_async.learner.main import set_up_interpreter
from diloco_async.models import plan_of
from diloco_async.models.transformer import ByteGPT
from diloco_async.protocol.messages import VersionInfo
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

LEARNER = "learner-0"


def peak_rss_bytes() -> int:
    """This process's peak RSS so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _group_start(spec: dict):
    """The group, its workload sharded and v0 adopted; and the store, the plan and the versions."""
    set_up_interpreter()  # a learner rank's: one torch thread, the C heap's thresholds and arenas
    group = LearnerGroup.from_env(600.0)
    assert group is not None
    # the baseline as benchmarks/memory.py takes it: torch and the project imported, and one tiny inner
    # step (the code torch loads lazily on a first step, autograd and AdamW, is not the model's)
    tiny = ByteGPT(ModelConfig(n_layer=2, d_model=16, n_head=2, context=8))
    x = torch.randint(0, 256, (2, 8))
    inner_step(tiny, torch.optim.AdamW(tiny.parameters()), x, x, lr=1e-3, grad_clip=1.0)
    del tiny
    baseline = psutil.Process().memory_info().rss
    cfg = Config.model_validate(spec["config"])
    store = ObjectStore(spec["store"])
    versions = {k: [VersionInfo.model_validate(v) for v in vs] for k, vs in spec["versions"].items()}
    workload = Workload.from_config(cfg, 0, 0)
    place_workload(workload, cfg, 0, group.local_rank)
    plan = plan_of(workload.model, cfg.synchronizer.num_fragments, cfg.synchronizer.fragmentation)
    group.share_start(workload)
    group.shard(workload, cfg, store, LEARNER, plan)
    group.start_sharded(spec["run_id"], versions["v0"])
    workload.load_data(cfg, 0)
    return group, workload, store, plan, versions, baseline


def memory_worker(spec: dict, out: Path) -> None:
    phases = {}
    group, workload, store, plan, versions, baseline = _group_start(spec)
    phases["built, sharded, v0 adopted"] = peak_rss_bytes()
    for step in range(spec["steps"]):
        workload.step(step)
        phases[f"inner step {step + 1}"] = peak_rss_bytes()
        phases[f"RSS now, after step {step + 1}"] = psutil.Process().memory_info().rss
    orders = [ContributionOrder(p, 1, 0, "fp32", f"bench{p}", spec["steps"], 1, 1.0) for p in range(plan.num_fragments)]
    group.outer.contribute(orders)
    phases["every fragment's shard put"] = peak_rss_bytes()
    for v in versions["v1"]:  # one fragment per step boundary, as a run's versions come (streaming)
        group.outer.adopt([v])
    phases["v1 adopted"] = peak_rss_bytes()
    meta = state_meta(spec["steps"], {v.fragment: v.version for v in versions["v1"]}, {})
    save_sharded_state(store, keys.learner_prefix(spec["run_id"], LEARNER), 1, workload, group.outer, meta, LEARNER)
    phases["inner state saved (DCP)"] = peak_rss_bytes()
    local_bytes = sum(4 * p.to_local().numel() for p in workload.params.values())
    Path(out / f"rank{group.rank}.json").write_text(json.dumps({
        "rank": group.rank, "world": group.world, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss_bytes(),
        "phases": phases, "local_param_bytes": local_bytes}))
    group.close()


def plain_worker(spec: dict, out: Path) -> None:
    group, workload, *_ = _group_start(spec)
    step, t_start, deadline = 0, 0.0, None
    while True:  # rank 0 decides when the timed span ends; every rank steps the same count
        if step == spec["warmup_steps"]:
            t_start = time.perf_counter()
            deadline = t_start + spec["plain_s"]
        done = torch.tensor([int(deadline is not None and time.perf_counter() >= deadline)])
        torch.distributed.broadcast(done, src=0)
        if done.item():
            break
        workload.step(step)
        step += 1
    timed = step - spec["warmup_steps"]
    if group.is_leader:
        Path(out / "plain.json").write_text(json.dumps({
            "tokens_per_s": timed * workload.tokens_per_step / (time.perf_counter() - t_start), "steps": timed}))
    group.close()


def main(argv: list[str]) -> int:
    """``MODE SPEC_JSON OUT`` (see the module's docstring); one rank's part."""
    mode, spec_path, out_dir = argv[:3]
    {"memory": memory_worker, "plain": plain_worker}[mode](json.loads(Path(spec_path).read_text()), Path(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
