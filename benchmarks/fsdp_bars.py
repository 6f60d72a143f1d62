"""`make bench-fsdp`: learner groups sharded with FSDP2 (issue 39), N = 2 ranks, gloo on this CPU.

* **memory** (a): a byte-level transformer of ``--d-model`` x ``--n-layer`` (>= 200M parameters by
  default), 2 ranks under torchrun (:mod:`benchmarks.fsdp_workers` ``memory``): built on the meta
  device and sharded, each rank's rows of v0 adopted, ``--steps`` inner steps, every fragment's
  outer-gradient shard put, v1 adopted, the inner state saved with DCP, all through the learner's
  own code over a ``file://`` store. Per rank: peak RSS minus its RSS after ``import torch``,
  joining the group and one tiny inner step (the interpreter + torch baseline, measured in the
  same process before the model is built); bar
  ``<= 6 x model fp32 bytes / N + largest fragment fp32 bytes / N``.
* **speed** (b): tokens/s of one FSDP2 learner of 2 ranks inside a run (a synchronizer and that
  learner as processes, :func:`benchmarks.hf_learner.in_run_tokens_per_s`, from its step records)
  against the same group in a plain loop (``plain``: the same model, batch and ranks, inner steps
  only), the plain loop measured before and after the run; bar >= 0.95 on the mean over ``--repeats``.
* (c) the largest model that trains end to end with 2 learners x 2 ranks is not a bar here: see
  docs/log/2026-12-06.md for the command and what was measured.

Usage: python -m benchmarks.fsdp_bars [--only memory|speed] [--d-model 1024] [--n-layer 16] [--steps 2]
       [--speed-d-model 256] [--speed-n-layer 4] [--run-s 60] [--plain-s 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.args import description, non_negative_int, positive_float, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.hf_learner import in_run_tokens_per_s
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.models import build_run_model, plan_of
from diloco_async.protocol.messages import VersionInfo
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.work import put_version

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "bench-fsdp"
N = 2
SPEED_GOAL = 0.95


def bench_config(d_model: int, n_layer: int, context: int, batch: int, fragments: int) -> Config:
    """The recipe of both sides: a byte-level transformer, one learner of N FSDP2 ranks."""
    return with_fields(load_config(None, []), {
        "model.d_model": d_model, "model.n_layer": n_layer, "model.n_head": max(1, d_model // 64),
        "model.context": context, "learners.batch_size": batch, "learners.count": 1, "learners.nproc_per_learner": N,
        "learners.parallelism": "fsdp", "learners.threads": 1, "synchronizer.num_fragments": fragments,
        "learners.checkpoint_every_s": 0.0, "data.cache_dir": str(REPO / "data")})


def publish(store: ObjectStore, cfg: Config) -> tuple[dict, int, int, int]:
    """v0 and v1 of every fragment (the seeded init, twice), built once here; returns the versions
    (JSON), the parameter count, the model's fp32 bytes and the largest fragment's fp32 bytes."""
    model = build_run_model(cfg)
    plan = plan_of(model, cfg.synchronizer.num_fragments, cfg.synchronizer.fragmentation)
    params = dict(model.named_parameters())
    versions: dict[str, list] = {"v0": [], "v1": []}
    for v, key in ((0, "v0"), (1, "v1")):
        for p in range(plan.num_fragments):
            ref = put_version(store, RUN_ID, p, v, {n: params[n].detach() for n in plan.names(p)})
            versions[key].append(VersionInfo(fragment=p, version=v, key=ref.key, nbytes=ref.nbytes,
                                             sha256=ref.sha256).model_dump())
    n_params = sum(t.numel() for t in params.values())
    largest = max(4 * sum(math.prod(s.shape) for s in plan.fragments[p]) for p in range(plan.num_fragments))
    return versions, n_params, 4 * n_params, largest


def torchrun(mode: str, spec: dict, tmp: Path) -> Path:
    """Run :mod:`benchmarks.fsdp_workers` ``mode`` on N ranks; returns the folder its ranks wrote."""
    out = tmp / mode
    out.mkdir(exist_ok=True)
    spec_path = tmp / f"{mode}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO),
                                                                               os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(N),
                           "-m", "benchmarks.fsdp_workers", mode, str(spec_path), str(out)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} ranks exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return out


def memory_bars(args, tmp: Path) -> list[Bar]:
    store = ObjectStore(f"file://{tmp}/store-memory")
    cfg = bench_config(args.d_model, args.n_layer, args.context, args.batch, args.fragments)
    versions, n_params, model_bytes, largest = publish(store, cfg)
    goal = 6 * model_bytes / N + largest / N
    print(f"memory: byte-GPT {args.d_model} x {args.n_layer}: {n_params / 1e6:.1f}M parameters, "
          f"{model_bytes / 2**20:.0f} MiB fp32, largest fragment {largest / 2**20:.0f} MiB; N = {N}; "
          f"bar {goal / 2**20:.0f} MiB per rank", flush=True)
    out = torchrun("memory", {"config": cfg.model_dump(mode="json"), "store": store.url, "versions": versions,
                              "run_id": RUN_ID, "steps": args.steps}, tmp)
    bars = [Bar("model parameters (M)", n_params / 1e6, 200.0, detail="the issue's size: >= 200M")]
    for rank in range(N):
        r = json.loads((out / f"rank{rank}.json").read_text())
        beyond = r["peak_rss_bytes"] - r["baseline_rss_bytes"]
        print(f"rank {rank}: baseline {r['baseline_rss_bytes'] / 2**20:.0f} MiB, peak {r['peak_rss_bytes'] / 2**20:.0f}"
              f" MiB; peak after each phase (MiB): "
              + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r["phases"].items()), flush=True)
        bars.append(Bar(f"rank {rank}: peak RSS beyond baseline (MiB)", beyond / 2**20, goal / 2**20, kind="max",
                        detail=f"{beyond / (model_bytes / N):.2f} x (model fp32 / N)"))
    return bars


def speed_bars(args, tmp: Path) -> list[Bar]:
    store = ObjectStore(f"file://{tmp}/store-speed")
    cfg = bench_config(args.speed_d_model, args.speed_n_layer, args.speed_context, args.speed_batch, args.fragments)
    versions, n_params, _, _ = publish(store, cfg)
    print(f"speed: byte-GPT {args.speed_d_model} x {args.speed_n_layer}: {n_params / 1e6:.1f}M parameters, "
          f"{N} ranks x batch {args.speed_batch} x {args.speed_context} tokens", flush=True)
    spec = {"config": cfg.model_dump(mode="json"), "store": store.url, "versions": versions, "run_id": RUN_ID,
            "warmup_steps": args.warmup_steps, "plain_s": args.plain_s}
    ratios = []
    for rep in range(args.repeats):
        before = json.loads((torchrun("plain", spec, tmp) / "plain.json").read_text())["tokens_per_s"]
        inside, steps = in_run_tokens_per_s(cfg, tmp / f"run{rep}", args.run_s, args.warmup_steps)
        after = json.loads((torchrun("plain", spec, tmp) / "plain.json").read_text())["tokens_per_s"]
        ratios.append(inside / ((before + after) / 2))
        print(f"[{rep}] plain {before:.0f} / in a run {inside:.0f} ({steps} steps) / plain {after:.0f} tokens/s: "
              f"ratio {ratios[-1]:.3f}", flush=True)
    ratio, half = mean_interval(ratios)
    return [Bar("FSDP2 learner in a run / plain FSDP2 loop, tokens/s", ratio, SPEED_GOAL,
                detail=f"+- {half:.3f} (95%) over {len(ratios)} repeat(s)")]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fsdp_bars", description=description(__doc__))
    ap.add_argument("--only", choices=["memory", "speed"], default=None)
    ap.add_argument("--d-model", type=positive_int, default=1024)
    ap.add_argument("--n-layer", type=positive_int, default=16)
    ap.add_argument("--context", type=positive_int, default=64)
    ap.add_argument("--batch", type=positive_int, default=1, help="windows per rank and step (memory)")
    ap.add_argument("--steps", type=positive_int, default=2, help="inner steps of the memory run")
    ap.add_argument("--fragments", type=positive_int, default=4)
    ap.add_argument("--speed-d-model", type=positive_int, default=256)
    ap.add_argument("--speed-n-layer", type=positive_int, default=4)
    ap.add_argument("--speed-context", type=positive_int, default=128)
    ap.add_argument("--speed-batch", type=positive_int, default=4)
    ap.add_argument("--run-s", type=positive_float, default=60.0)
    ap.add_argument("--plain-s", type=positive_float, default=20.0)
    ap.add_argument("--warmup-steps", type=non_negative_int, default=5)
    ap.add_argument("--repeats", type=positive_int, default=2, help="(plain, run, plain) measurements of the speed bar")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    bars: list[Bar] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "memory"):
            bars += memory_bars(args, Path(tmp))
        if args.only in (None, "speed"):
            bars += speed_bars(args, Path(tmp))
    print(f"({time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})")
    return print_bars(bars, title="bench-fsdp")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
