"""`make bench-hf`: tokens/s of one learner running the HF CPU recipe inside a run, against the
same model in a plain torch loop with the same batch, both measured in this run.

* plain loop: the learner's own inner step (``Workload.step``: the recipe's model, AdamW with the
  recipe's learning rate and weight decay, forward, backward, clip, step) on learner-0's batches,
  on its device and precision, in this process with the learner's thread count; measured before
  and after the run (their mean is the baseline, so a change of machine load during the run
  shows as a gap between the two);
* inside a run: a synchronizer and one learner (``learners.count = 1``) as processes over a
  file:// store, for ``--run-s`` seconds; tokens/s from the learner's timeline (its step records,
  first ``--warmup-steps`` skipped): everything between two steps (adopting versions, outer
  gradient snapshots, the comms thread's uploads and heartbeats) counts against the learner.

Bar: inside / plain >= 0.95, on the mean over ``--repeats`` (each repeat measures plain, run,
plain again), printed with its 95% t-interval. Exit status 1 on a miss.

Usage: python -m benchmarks.hf_learner [--config configs/hf-llama-cpu.toml] [--run-s 75] [--plain-s 25]
       [--repeats 3] [--set section.field=value ...]

``--set`` changes the recipe for both sides, e.g. on a GPU machine
``--config configs/gpt2-gpu.toml --set 'learners.device="cuda"' --set learners.count=1``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.args import description, non_negative_int, positive_float, positive_int
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.inner.workload import Workload
from diloco_async.learner.group import place_workload
from diloco_async.metrics.timeline import read_records
from diloco_async.models import build_run_model
from diloco_async.run import RunProcesses
from diloco_async.runtime.devices import set_cpu_math

GOAL = 0.95


def plain_loop_tokens_per_s(cfg: Config, seconds: float, warmup_steps: int) -> tuple[float, int]:
    """Tokens/s of learner-0's inner steps alone, after ``warmup_steps``; and the steps timed.

    The learner's own :class:`~diloco_async.inner.workload.Workload` (the recipe's model, AdamW, warm-up,
    clipping) on learner-0's shard, placed on learner-0's device and precision as the learner places
    it, stepped in this process with ``learners.threads`` threads and nothing else: no synchronizer,
    no comms thread, no snapshots; its CPU math set as the learner sets it (``learners.threads``,
    ``learners.flush_denormal``). Each step ends with the loss read back (a device sync on a GPU),
    as in the learner.
    """
    set_cpu_math(cfg.learners.threads, cfg.learners.flush_denormal)
    workload = Workload.from_config(cfg, 0, 0)
    place_workload(workload, cfg, 0)
    workload.load_data(cfg, 0)
    steps, t_start = 0, 0.0
    deadline = None
    while deadline is None or time.perf_counter() < deadline:
        if steps == warmup_steps:
            t_start = time.perf_counter()
            deadline = t_start + seconds
        workload.step(steps)
        steps += 1
    timed = steps - warmup_steps
    return timed * workload.tokens_per_step / (time.perf_counter() - t_start), timed


def in_run_tokens_per_s(base: Config, workdir: Path, seconds: float, warmup_steps: int) -> tuple[float, int]:
    """Tokens/s of learner-0 in a run of one learner of ``base`` (the resolved recipe, e.g. with the
    model size), from its step records; and the steps timed."""
    run = RunProcesses(with_fields(base, {
        "run.store": f"file://{workdir}/store", "run.workdir": f"{workdir}/runs", "learners.count": 1,
        "budget.wall_s": float(seconds), "budget.tokens": 1_000_000_000_000, "synchronizer.min_quorum": 1}))
    try:
        run.start_synchronizer()
        run.start_learner(0)
        assert run.sync is not None
        deadline = time.monotonic() + seconds + 120
        while run.sync.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        run.stop_all()
    for log in sorted((run.workdir / "logs").glob("learner-0*.log")):
        ready = [line for line in log.read_text(errors="replace").splitlines() if " ready: " in line]
        print(ready[-1].split(" ready: ", 1)[-1][:200] if ready else f"{log.name}: no ready line", flush=True)
    steps = sorted((r for r in read_records(run.workdir / "timeline" / "learner-0.jsonl") if r["kind"] == "step"),
                   key=lambda r: r["step"])[warmup_steps:]
    if len(steps) < 2:
        tails = "".join(f"\n--- {log.name} (last lines)\n"
                        + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                        for log in sorted((run.workdir / "logs").glob("*.log")))
        raise RuntimeError(f"the learner made {len(steps)} steps after warm-up; logs in {run.workdir / 'logs'}{tails}")
    # from the start of the first timed step to the start of the last: every gap between steps counts
    tokens = sum(r["tokens"] for r in steps[:-1])
    span_s = steps[-1]["t0"] - steps[0]["t0"]
    in_steps_s = sum(r["t1"] - r["t0"] for r in steps[:-1])
    print(f"learner: {in_steps_s / span_s:.3f} of the time inside inner steps, the rest between steps", flush=True)
    return tokens / span_s, len(steps) - 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hf_learner", description=description(__doc__))
    ap.add_argument("--config", default="configs/hf-llama-cpu.toml")
    ap.add_argument("--run-s", type=positive_float, default=75.0, help="wall seconds of the run (budget.wall_s)")
    ap.add_argument("--plain-s", type=positive_float, default=25.0, help="seconds of each plain-loop measurement")
    ap.add_argument("--warmup-steps", type=non_negative_int, default=5)
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="measurements of (plain, run, plain), for an interval")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a recipe setting for the plain loop and the run (repeatable)")
    args = ap.parse_args(argv)
    try:  # a bad --set or recipe is the command line's error, before anything starts
        cfg = load_config(args.config, args.overrides)
    except (OSError, ValueError) as err:
        ap.error(str(err))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        n_params = sum(p.numel() for p in build_run_model(cfg).parameters())
        print(f"model {cfg.model.kind}/{cfg.model.hf.architecture}: {n_params / 1e6:.2f}M parameters, batch "
              f"{cfg.learners.batch_size} x {cfg.model.context} tokens, {cfg.learners.threads} thread(s), "
              f"{cfg.learners.device_of(0)} {cfg.learners.precision}", flush=True)
        ratios, plains, insides = [], [], []
        for rep in range(args.repeats):
            before, n_before = plain_loop_tokens_per_s(cfg, args.plain_s, args.warmup_steps)
            print(f"[{rep}] plain loop (before): {before:9.1f} tokens/s over {n_before} steps", flush=True)
            inside, n_inside = in_run_tokens_per_s(cfg, Path(tmp) / f"r{rep}", args.run_s, args.warmup_steps)
            print(f"[{rep}] learner in a run:    {inside:9.1f} tokens/s over {n_inside} steps", flush=True)
            after, n_after = plain_loop_tokens_per_s(cfg, args.plain_s, args.warmup_steps)
            print(f"[{rep}] plain loop (after):  {after:9.1f} tokens/s over {n_after} steps", flush=True)
            plains.append((before + after) / 2)
            insides.append(inside)
            ratios.append(inside / plains[-1])
    ratio, half = mean_interval(ratios)
    ok = ratio >= GOAL
    print(f"\nratios per repeat {[round(r, 3) for r in ratios]}: mean {ratio:.3f} +- {half:.3f} (95%)")
    print(f"\n{'figure':58s} {'value':>8s}   goal")
    print(f"{'plain loop tokens/s (mean)':58s} {sum(plains) / len(plains):8.1f}")
    print(f"{'learner in a run tokens/s (mean)':58s} {sum(insides) / len(insides):8.1f}")
    print(f"{'learner in a run / plain loop, tokens/s (mean ratio)':58s} {ratio:8.3f}   >= {GOAL:<6g}  "
          f"{'ok' if ok else 'MISS'}")
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
