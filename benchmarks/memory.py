"""Memory near the model's size (issue 17 item 3): RSS of a real learner and a real synchronizer.

Each size runs ``--repeats`` (3) short real runs (a ByteGPT recipe sized with ``--set model.*``, the synchronizer
and learners as processes over a ``file://`` store, as ``make run`` starts them, without MLflow)
and samples every process's RSS with psutil. The baselines are the same interpreter with torch
and the modules each process imports (:data:`BASELINE_CODE`, which also takes one tiny inner step
for the learner; :data:`SYNC_BASELINE_CODE` for the synchronizer), measured in the same run.
The run checkpoints (synchronizer and learners' inner states) and merges several rounds while
it is sampled. Each bar is the mean of a size's runs, printed with its 95% t-interval. Figures,
in units of the model's fp32 size (4 bytes per parameter):

* learner: peak RSS minus the baseline; goal <= 6 (parameters, gradients, AdamW moments, base
  copies: 5, plus activations of a small batch and the comms thread's buffers);
* synchronizer: peak RSS minus the baseline, minus the S kept versions in their compact form
  (published versions live in the store and are decoded on demand, so that term is 0 in RAM);
  goal <= 4 (value, momentum, the merge's working set).
* each of the two against the capacity plan of the same config (:mod:`diloco_async.capacity`,
  docs/capacity-plan.md): ``|measured / planned - 1|``, goal <= 0.15 (not in ``--quick``, whose 1M model
  is mostly fixed buffers).

``--big`` (``make bench-memory-big``): a 100M-parameter run with 2 learners, 24 global steps
with H = 4 (bar: it exits 0 after 4 merges at least; its RSS and how long it took are printed).
``--tokens``: learner tokens/s with sync on against a plain loop at ~48M
parameters (:mod:`benchmarks.hf_learner`'s method; bar >= 0.95 of the plain loop).

Usage: python -m benchmarks.memory [--quick] [--big] [--tokens] [--sizes 25,50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.args import description, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.sizes import SIZES
from benchmarks.stats import mean_over_runs
from diloco_async.capacity import make_plan
from diloco_async.capacity.recipe import inputs_from_config
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.run import RunProcesses

__all__ = ["bars", "main", "measure_run", "run_fields", "plan_bars"]

LEARNER_GOAL = 6.0
SYNC_GOAL = 4.0
TOKENS_GOAL = 0.95
PLAN_GOAL = 0.15  # issue 40: the capacity plan within 15% of the measured RSS
REPEATS = 3  # runs of each size: the synchronizer's peak at 50M varied 3.55-4.02x between single runs

#: the baseline process: the interpreter with torch and the project's modules imported, and one
#: inner step of a 2-layer, 16-wide ByteGPT (so that the code torch loads lazily on a first
#: step, autograd, AdamW and its compile machinery, about 70 MiB, is in the baseline too)
BASELINE_CODE = (
    "import sys, torch; torch.set_num_threads(1); import diloco_async.learner, diloco_async.sync, "
    "diloco_async.server\n"
    "from diloco_async.config.schema import ModelConfig\nfrom diloco_async.models.transformer import ByteGPT\n"
    "from diloco_async.inner.workload import inner_step\n"
    "m = ByteGPT(ModelConfig(n_layer=2, d_model=16, n_head=2, context=8))\n"
    "x = torch.randint(0, 256, (2, 8))\n"
    "inner_step(m, torch.optim.AdamW(m.parameters()), x, x, lr=1e-3, grad_clip=1.0)\n"
    "print('ready', flush=True); sys.stdin.read()")

#: the synchronizer's baseline: the same interpreter with what a synchronizer process imports, and
#: nothing built (it never runs an inner step, so the learner's baseline would be too high for it)
SYNC_BASELINE_CODE = (
    "import sys, torch; torch.set_num_threads(1); import diloco_async.sync, diloco_async.server\n"
    "print('ready', flush=True); sys.stdin.read()")


def baseline_rss_bytes(code: str = BASELINE_CODE) -> int:
    """RSS of ``code`` (:data:`BASELINE_CODE` or :data:`SYNC_BASELINE_CODE`) once it has imported
    everything (bytes)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        time.sleep(0.5)
        return psutil.Process(proc.pid).memory_info().rss
    finally:
        proc.communicate("")


@dataclass
class RunMemory:
    """Peak RSS (bytes) of each process of one run, with the model's size and the run's time."""

    n_params: int
    peak_rss: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    exit_code: int | None = None
    merges: int = 0
    series: list[tuple[float, str, int]] = field(default_factory=list)  # (s since start, process, RSS bytes)
    logs: Path | None = None

    @property
    def model_bytes(self) -> int:
        return 4 * self.n_params


def _n_params(size: dict[str, int]) -> int:
    from diloco_async.models import build_run_model, trainable_parameters
    cfg = with_fields(Config(), size)
    return sum(p.numel() for p in trainable_parameters(build_run_model(cfg)).values())


def run_fields(size: dict[str, int], *, learners: int = 2, sync_every: int = 8) -> dict[str, object]:
    """The fields of a measured run that shape its memory (the model, M, the batch, H, P): what
    :func:`measure_run` sets, and what the capacity plan of the run is given."""
    return {**size, "learners.count": learners, "learners.batch_size": 2, "synchronizer.sync_every": sync_every,
            "synchronizer.num_fragments": 4}


def measure_run(size: dict[str, int], workdir: Path, *, learners: int = 2, wall_s: float = 60.0,
                max_steps: int = 48, sync_every: int = 8, checkpoint_every_s: float = 8.0,
                interval_s: float = 0.1) -> RunMemory:
    """A short real run of ``learners`` learners; the peak RSS of every process, sampled every
    ``interval_s``, until the synchronizer exits (budget ``max_steps`` global steps or ``wall_s``)."""
    cfg = with_fields(Config(), {
        **run_fields(size, learners=learners, sync_every=sync_every), "run.store": f"file://{workdir}/store",
        "run.workdir": f"{workdir}/runs", "learners.warmup_steps": 2,
        "learners.checkpoint_every_s": checkpoint_every_s, "synchronizer.checkpoint_every_s": checkpoint_every_s,
        "budget.wall_s": wall_s, "budget.tokens": 1_000_000_000_000, "budget.max_steps": max_steps,
        "tracking.eval_every_s": 0.0})
    out = RunMemory(_n_params(size))
    run = RunProcesses(cfg)
    t0 = time.monotonic()
    try:
        run.start_synchronizer()
        for i in range(learners):
            run.start_learner(i)
        assert run.sync is not None
        deadline = t0 + wall_s + 180
        while run.sync.poll() is None and time.monotonic() < deadline:
            procs = {"synchronizer": run.sync.pid, **{lid: h.pid for lid, h in run.learners.items()}}
            for name, pid in procs.items():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                out.peak_rss[name] = max(out.peak_rss.get(name, 0), rss)
                out.series.append((time.monotonic() - t0, name, rss))
            run.supervise()
            time.sleep(interval_s)
        out.exit_code = run.sync.poll()
    finally:
        run.stop_all()
    out.seconds = time.monotonic() - t0
    out.logs = run.workdir / "logs"
    try:  # outer steps taken: "fragment p round n merged k (...) -> version v" lines
        text = (out.logs / "synchronizer.log").read_text(errors="replace")
        out.merges = sum(1 for line in text.splitlines() if " merged " in line and "-> version" in line)
    except OSError:
        pass
    return out


def _ratios(size: int, mem: RunMemory, base: int, sync_base: int) -> tuple[float | None, float | None]:
    """One run's (learner, synchronizer) peak RSS beyond their baselines in fp32 model sizes, printed."""
    mb = mem.model_bytes
    learner_peak = max((v for k, v in mem.peak_rss.items() if k.startswith("learner")), default=None)
    sync_peak = mem.peak_rss.get("synchronizer")
    lr = None if learner_peak is None else (learner_peak - base) / mb
    sr = None if sync_peak is None else (sync_peak - sync_base) / mb
    print(f"{size}M ({mem.n_params / 1e6:.1f}M parameters, {mb / 2**20:.0f} MiB fp32): "
          f"baselines {base / 2**20:.0f} MiB (learner), {sync_base / 2**20:.0f} MiB (synchronizer), "
          f"peaks " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(mem.peak_rss.items()))
          + f"; learner {lr if lr is None else round(lr, 2)}x, synchronizer {sr if sr is None else round(sr, 2)}x "
          f"beyond the baseline ({mem.seconds:.0f} s, {mem.merges} merges, exit {mem.exit_code})", flush=True)
    return lr, sr


def _size_bars(size: int, mems: list[RunMemory], base: int, sync_base: int) -> list[Bar]:
    """The two RSS bars of ``size`` over its runs: each the mean of the runs' ratios, with its 95%
    t-interval in the detail (a run without a figure makes the bar unmeasured)."""
    per_run = [_ratios(size, mem, base, sync_base) for mem in mems]
    lr, lr_detail = mean_over_runs([r[0] for r in per_run])
    sr, sr_detail = mean_over_runs([r[1] for r in per_run])
    what = f"peak RSS - baseline, in fp32 model sizes; {mems[0].n_params / 1e6:.1f}M params"
    return [Bar(f"learner RSS beyond baseline / model fp32, {size}M", lr, LEARNER_GOAL, "max",
                f"{lr_detail}; {what}"),
            Bar(f"synchronizer RSS beyond baseline / model fp32, {size}M (versions in the store)", sr, SYNC_GOAL,
                "max", f"{sr_detail}; {what}")]


def plan_bars(size: int, fields: dict[str, object], learner: float | None, sync: float | None) -> list[Bar]:
    """How far the measured RSS ratios (``learner``, ``sync``: fp32 model sizes beyond the baselines,
    None when not measured) are from the capacity plan of the run's config ``fields``."""
    plan = make_plan(inputs_from_config(with_fields(Config(), fields)))
    model = 4 * plan.inputs.model.n_params
    out = []
    pairs = (("learner", learner, plan.learner_rank), ("synchronizer", sync, plan.synchronizer_shard))
    for who, measured, mem in pairs:
        planned = mem.host_bytes / model
        off = None if measured is None else abs(measured / planned - 1)
        out.append(Bar(f"{who} RSS off the capacity plan, {size}M: |measured / planned - 1|", off, PLAN_GOAL, "max",
                       f"measured {measured if measured is None else round(measured, 2)}, planned {planned:.2f} "
                       "fp32 model sizes (docs/capacity-plan.md)"))
    return out


def bars(quick: bool = False, sizes: tuple[int, ...] = (25, 50), big: bool = False,
         tokens: bool = False, repeats: int = REPEATS) -> list[Bar]:
    """Measure and return the memory bars: ``repeats`` runs of each size (``quick``: one tiny run,
    for a test)."""
    out: list[Bar] = []
    with tempfile.TemporaryDirectory() as tmp:
        base, sync_base = baseline_rss_bytes(), baseline_rss_bytes(SYNC_BASELINE_CODE)
        for size in ((1,) if quick else sizes):
            mems = [measure_run(SIZES[size], Path(tmp) / f"m{size}-{rep}", max_steps=24 if quick else 48,
                                wall_s=40 if quick else 90) for rep in range(1 if quick else repeats)]
            measured = _size_bars(size, mems, base, sync_base)
            out += measured
            if not quick:
                out += plan_bars(size, run_fields(SIZES[size]), measured[0].value, measured[1].value)
        if big:
            mem = measure_run(SIZES[100], Path(tmp) / "m100", max_steps=24, sync_every=4, wall_s=420,
                              checkpoint_every_s=30)
            measured = _size_bars(100, [mem], base, sync_base)
            out += measured + plan_bars(100, run_fields(SIZES[100], sync_every=4), measured[0].value,
                                        measured[1].value)
            ok = mem.exit_code == 0 and mem.merges >= 4  # every fragment took an outer step
            print(f"100M run with 2 learners: exit {mem.exit_code} after {mem.seconds:.0f} s, {mem.merges} merges",
                  flush=True)
            out.append(Bar("100M-parameter run with 2 learners completes (1 = yes)", 1.0 if ok else 0.0, 1.0, "min",
                           f"{mem.seconds:.0f} s, {mem.merges} merges, exit {mem.exit_code}"))
    if tokens:
        from benchmarks.memory_tokens import tokens_bar
        out.append(tokens_bar(quick=quick))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=description(__doc__))
    ap.add_argument("--quick", action="store_true", help="one tiny run (for a test)")
    ap.add_argument("--big", action="store_true", help="also the 100M-parameter run with 2 learners")
    ap.add_argument("--tokens", action="store_true", help="also learner tokens/s vs a plain loop at ~48M")
    ap.add_argument("--repeats", type=positive_int, default=REPEATS, help="runs of each size, for the mean")
    ap.add_argument("--sizes", default="25,50", help="model sizes in M parameters (of 1, 25, 50, 100; none: no runs)")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip() and s != "none")
    return print_bars(bars(quick=args.quick, sizes=sizes, big=args.big, tokens=args.tokens,
                            repeats=args.repeats), title="memory bars")


if __name__ == "__main__":
    sys.exit(main())
