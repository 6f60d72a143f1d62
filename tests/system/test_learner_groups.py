"""Devices, precision, per-learner batch sizes and learners that span several processes.

* equivalence: a 2-rank learner (torchrun, gloo, DDP) with per-rank batch b gives the outer
  gradient of a 1-process learner with batch 2b over the same windows and steps, including an
  adoption broadcast mid-way; so does one with per-rank batch b/2 and 2 micro-batches accumulated
  per step (``learners.grad_accum_steps``, DDP's no_sync on the first);
* a run with ``nproc_per_learner = 2`` (bf16 autocast) trains end to end through the
  synchronizer; SIGKILL of one rank restarts that learner's whole group and merges go on;
* bf16 autocast on CPU keeps parameters and outer gradients float32;
* learners with batch sizes [8, 16] show their token weights in the merge log;
* a bad device is an error before anything starts, naming the value.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from test_integration import tiny_recipe
from test_learner_faults import config, run_cluster
from torchrun_group import dump_stacks_if_hung, run_torchrun

from diloco_async.config.schema import load_config
from diloco_async.inner.workload import Workload
from diloco_async.learner.group import Decision, LearnerGroup, place_workload
from diloco_async.learner.rules import outer_gradient
from diloco_async.models.transformer import embedding_names
from diloco_async.policy.fragments import plan_fragments, specs_of
from diloco_async.protocol.client import fetch_status
from diloco_async.run import RunProcesses
from diloco_async.runtime.devices import check_devices, resolve_device
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

from polling import wait_until

REPO = Path(__file__).resolve().parents[2]
STEPS, ADOPT_AT, PER_RANK_BATCH = 6, 3, 4


def small_config(batch_size: int, *extra: str):
    return load_config(None, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=32", "learners.count=1",
        f"learners.batch_size={batch_size}", "learners.warmup_steps=2", "synchronizer.num_fragments=2",
        f"data.cache_dir=\"{REPO / 'data'}\"", *extra])


def train_steps(workload: Workload, adopt) -> dict[str, torch.Tensor]:
    """Train STEPS steps from the current parameters, calling ``adopt(workload)`` before step
    ADOPT_AT; returns the outer gradient Θ^base − θ (Θ^base: the parameters at the start)."""
    base = {n: p.detach().clone() for n, p in workload.params.items()}
    for step in range(STEPS):
        if step == ADOPT_AT:
            adopt(workload)
        workload.step(step)
    return outer_gradient(base, {n: p.detach() for n, p in workload.params.items()})


def adopted_values(workload: Workload) -> dict[str, torch.Tensor]:
    """Deterministic 'published version' of the embedding tensors, adopted mid-way."""
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) * 0.02 for n, p in workload.params.items() if "emb" in n}


def group_worker(out: str, accum: int = 1, optimizer: str = "adamw") -> None:
    """One rank of the equivalence test's torchrun group (run as a script under torchrun), with
    ``accum`` micro-batches of PER_RANK_BATCH / accum windows per step and inner ``optimizer``."""
    torch.set_num_threads(1)
    group = LearnerGroup.from_env(60.0)
    assert group is not None
    cfg = small_config(PER_RANK_BATCH // accum, f"learners.grad_accum_steps={accum}",
                       f"learners.optimizer={optimizer}")
    torch.manual_seed(1 + group.rank)  # different inits: rank 0's reaches the others by the group's broadcasts
    workload = Workload.from_config(cfg, 0, 0)
    place_workload(workload, cfg, 0, group.local_rank)
    plan = plan_fragments(specs_of({n: p.detach() for n, p in workload.params.items()}), 2,
                          embedding_names(workload.model))
    group.share_start(workload)
    group.wrap(workload)
    workload.load_data(cfg, 0)

    def adopt(w: Workload) -> None:
        new = adopted_values(w) if group.is_leader else {}
        with torch.no_grad():
            for n, v in new.items():
                w.params[n].copy_(v)
        frags = sorted({p for p in range(plan.num_fragments) for n in plan.names(p) if "emb" in n})
        group.boundary(Decision(adopted=frags) if group.is_leader else None, w, plan)

    delta = train_steps(workload, adopt)
    if group.is_leader:
        torch.save({"delta": delta, "tokens_per_step": workload.tokens_per_step}, out)
    group.close()


@pytest.mark.parametrize(("accum", "optimizer"), [(1, "adamw"), (2, "adamw"), (1, "muon")])
def test_two_rank_learner_matches_one_process_with_twice_the_batch(tmp_path, accum, optimizer):
    out = tmp_path / "group.pt"
    # this file runs as a script: the repository, the tests' helpers and the tier folders it imports from
    path = [REPO, REPO / "tests", REPO / "tests" / "contract", REPO / "tests" / "system"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = run_torchrun(__file__, ["--group-worker", str(out), "--accum", str(accum), "--optimizer", optimizer],
                        tmp_path, env=env)
    # the whole of stderr: a rank's own traceback comes before the agent's report (CI of 174db0a cut it off)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-20000:]
    group = torch.load(out)

    torch.manual_seed(1)  # rank 0's initialisation
    cfg = small_config(2 * PER_RANK_BATCH, f"learners.optimizer={optimizer}")
    single = Workload.from_config(cfg, 0, 0)
    single.load_data(cfg, 0)

    def adopt(w: Workload) -> None:
        with torch.no_grad():
            for n, v in adopted_values(w).items():
                w.params[n].copy_(v)

    delta = train_steps(single, adopt)
    assert group["tokens_per_step"] == single.tokens_per_step == 2 * PER_RANK_BATCH * 32
    num = sum(float((group["delta"][n] - d).pow(2).sum()) for n, d in delta.items()) ** 0.5
    den = sum(float(d.pow(2).sum()) for d in delta.values()) ** 0.5
    assert den > 0
    assert num / den < 1e-5, f"relative difference of the outer gradients {num / den:.3e}"


def test_bf16_autocast_on_cpu_trains_and_keeps_outer_gradients_fp32():
    cfg = small_config(8, "learners.precision=\"bf16\"")
    torch.manual_seed(0)
    workload = Workload.from_config(cfg, 0, 0)
    place_workload(workload, cfg, 0)
    assert workload.amp_dtype == torch.bfloat16
    workload.load_data(cfg, 0)
    seen: list[torch.dtype] = []
    linear = next(m for m in workload.model.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    base = {n: p.detach().clone() for n, p in workload.params.items()}
    losses = [workload.step(s) for s in range(40)]
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen), "the forward did not run under bf16 autocast"
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    delta = outer_gradient(base, {n: p.detach() for n, p in workload.params.items()})
    assert all(p.dtype == torch.float32 for p in workload.params.values())
    assert all(d.dtype == torch.float32 and torch.isfinite(d).all() for d in delta.values())
    assert all(st["exp_avg"].dtype == torch.float32 for st in workload.optimizer.state.values())


def test_bad_devices_are_errors_that_name_the_value(tmp_path):
    for overrides, words in [
        (['learners.device="tpu"'], ["'tpu'"]),
        (['learners.device=["cpu", "cpu"]'], ["learners.device", "learners.count=4"]),
        (['learners.nproc_per_learner=2', 'learners.device="cuda:1"'], ["'cuda:1'", "nproc_per_learner=2"]),
        (['learners.nnodes=2'], ["rdzv_endpoint"]),
    ]:
        with pytest.raises(ValueError) as err:
            load_config(None, overrides)
        assert all(w in str(err.value) for w in words), str(err.value)
    lc = load_config(None, ['learners.device="cuda"', "learners.count=1"]).learners
    with pytest.raises(ValueError, match="'cuda' but no CUDA GPU"):
        check_devices(lc, cuda_count=0, has_mps=False)
    with pytest.raises(ValueError, match=r"'cuda:3' needs cuda:3 but only 2"):
        resolve_device("cuda:3", cuda_count=2, has_mps=False)
    with pytest.raises(ValueError, match="needs cuda:1 but only 1"):  # 2 ranks on 1 GPU
        check_devices(load_config(None, ['learners.device="cuda"', "learners.count=1",
                                         "learners.nproc_per_learner=2"]).learners, cuda_count=1, has_mps=False)
    with pytest.raises(ValueError, match="'mps' but MPS"):
        resolve_device("mps", cuda_count=0, has_mps=False)
    assert resolve_device("auto", cuda_count=0, has_mps=False).type == "cpu"
    assert str(resolve_device("auto", 1, 2, cuda_count=2, has_mps=False)) == "cuda:1"
    assert str(resolve_device("auto", 0, 2, cuda_count=1, has_mps=False)) == "cpu"  # not every rank gets a GPU
    # before anything starts: no synchronizer, no learner, no run folder content
    if not torch.cuda.is_available():
        cfg = load_config(None, ['learners.device="cuda"', f'run.workdir="{tmp_path}/runs"',
                                 f'run.store="file://{tmp_path}/store"'])
        with pytest.raises(ValueError, match="learner 0: learners.device='cuda' but no CUDA GPU"):
            RunProcesses(cfg)
        assert not (tmp_path / "runs").exists()


def test_learner_group_command_lines(tmp_path):
    class Recorder:
        def start(self, name, argv, env):
            self.argv = argv
            return None

    cfg = load_config(None, [f'run.workdir="{tmp_path}/runs"', f'run.store="file://{tmp_path}/store"',
                             "learners.nproc_per_learner=2", "learners.nnodes=2",
                             'learners.rdzv_endpoint="head:29400"'])
    launcher = Recorder()
    run = RunProcesses(cfg, run_id="r1", launcher=launcher)
    run.sync_url = "http://127.0.0.1:1"
    run.learner_handle(3, 2)
    argv = " ".join(launcher.argv)
    assert argv.startswith("-m torch.distributed.run --nproc-per-node 2 --nnodes 2 --max-restarts 0"), argv
    assert "--rdzv-backend c10d --rdzv-endpoint head:29400 --rdzv-id r1-learner-3-2" in argv
    assert "--module diloco_async.learner --learner-id learner-3 --index 3" in argv and "--incarnation 2" in argv
    one = load_config(None, [f'run.workdir="{tmp_path}/runs"', f'run.store="file://{tmp_path}/store"'])
    run = RunProcesses(one, run_id="r2", launcher=launcher)
    run.sync_url = "http://127.0.0.1:1"
    run.learner_handle(0, 0)
    assert launcher.argv[:2] == ["-m", "diloco_async.learner"]


def test_learners_with_different_batch_sizes_show_their_token_weights_in_the_merge_log():
    cfg = config(**{"learners.count": 2, "learners.batch_size": "[8, 16]", "synchronizer.min_quorum": 2})
    store = ObjectStore(f"memory://groups-{time.time_ns()}")
    status = asyncio.run(run_cluster(cfg, {"learner-0": store, "learner-1": store},
                                     lambda st: min(st["versions"].values()) >= 3))
    lines = store.get_unverified(keys.merge_log_key("frun", status["epoch"])).decode().splitlines()
    merges = [json.loads(line) for line in lines if line.strip()]
    assert len(merges) >= 3
    context = cfg.model.context
    for m in merges:
        by = {c["learner"]: c for c in m["contributions"]}
        assert set(by) == {"learner-0", "learner-1"}, m
        for lid, batch in (("learner-0", 8), ("learner-1", 16)):
            c = by[lid]
            assert c["c_tokens"] == c["c_steps"] * batch * context, c
            assert c["token_weight"] == pytest.approx(c["c_tokens"] ** 2 / c["c_steps"])
        # per step, the learner with twice the batch weighs twice as much (c_tokens²/c_steps = c_tokens · tokens/step)
        per_step = {lid: by[lid]["token_weight"] / by[lid]["c_tokens"] for lid in by}
        assert per_step["learner-1"] == pytest.approx(2 * per_step["learner-0"])


def group_overrides(tmp_path: Path) -> list[str]:
    """On top of test_integration's tiny recipe: one learner of 2 ranks, bf16."""
    return [f'run.workdir="{tmp_path}/runs"', "learners.batch_size=4", "learners.nproc_per_learner=2",
            'learners.precision="bf16"', "learners.checkpoint_every_s=0", "learners.restart_delay_s=0.5",
            "learners.heartbeat_s=0.1", "learners.group_timeout_s=60", "synchronizer.num_fragments=2",
            "synchronizer.sync_every=8", "synchronizer.heartbeat_timeout_s=3.0"]


def ranks_of(handle) -> dict[int, psutil.Process]:
    """The learner processes under a torchrun agent, by their RANK."""
    out = {}
    for child in psutil.Process(handle.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and "diloco_async.learner" in " ".join(child.cmdline()):
            out[int(rank)] = child
    return out


def test_two_rank_learner_trains_end_to_end_and_a_killed_rank_restarts_its_group(tmp_path):
    recipe, overrides = tiny_recipe(tmp_path, learners=1, wall_s=600), group_overrides(tmp_path)
    run = RunProcesses(load_config(recipe, overrides))
    try:
        url = run.start_synchronizer()
        handle = run.start_learner(0)

        def versions() -> int:
            run.supervise()
            st = fetch_status(url)
            return min(st["versions"].values())

        wait_until(lambda: versions() >= 2, 240, "two versions of every fragment from the 2-rank learner")
        ranks = wait_until(lambda: ranks_of(handle) if len(ranks_of(handle)) == 2 else None, 30, "both ranks")
        st = fetch_status(url)
        assert list(st["learners"]) == ["learner-0"], st["learners"]  # the synchronizer sees one learner
        at_kill = versions()
        ranks[1].send_signal(signal.SIGKILL)
        wait_until(lambda: run.supervise() or run.supervisor.restarts, 60, "the group to be restarted")
        assert run.supervisor.restarts[0].index == 0 and run.supervisor.restarts[0].incarnation == 1
        wait_until(lambda: handle.poll() is not None, 30, "the old torchrun agent to exit")
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks.values())
        wait_until(lambda: versions() >= at_kill + 2, 240, "merges to go on after the restart")
        new_ranks = ranks_of(run.learners["learner-0"])
        assert sorted(new_ranks) == [0, 1]
        assert list(fetch_status(url)["learners"]) == ["learner-0"]
        # live: a state read when it holds (a 3 s heartbeat timeout may see a loaded learner lost for a moment)
        wait_until(lambda: fetch_status(url)["learners"]["learner-0"]["live"], 60, "learner-0 live")
    finally:
        if run.sync is not None:
            run.sync.signal_group(signal.SIGTERM)
        run.finished_cleanly = False
        run.stop_all()
    log_text = (run.workdir / "logs" / "learner-0.log").read_text()
    assert "rank 1" in log_text and "on cpu (bf16, 2 rank(s))" in log_text


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-worker", required=True)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--optimizer", default="adamw")
    args = ap.parse_args()
    dump_stacks_if_hung()
    group_worker(args.group_worker, args.accum, args.optimizer)
