"""`make bench-chaos`, heterogeneity bars (issue 47): a slow learner still contributes, and a mixed
fleet turns the compute it has into merged progress about as well as a fleet at full speed.

Reads the files ``diloco-async chaos --scenario configs/chaos/heterogeneous.toml --out FILE`` wrote,
one per seed, for the scenario (``--het``) and for its full-speed baseline (``--full``: the same
command with ``--full-speed``, same seeds), and prints the bars table (benchmarks/bars.py):

* per learner slot: its merged share of the tokens over its share of the compute it had
  (``merged_over_capacity`` of the row's ``learners``: compute = time up x the tokens per second of
  its own inner steps, emulated slowdown included, :func:`~diloco_async.chaos.measure.step_stats`;
  merged tokens from the synchronizer's per-learner ledger) >= 0.8. That is: its merged tokens >=
  0.8 x its compute share x the tokens the run merged. A learner idle between steps, refused, late
  or merged at a reduced direction factor keeps its compute share and loses merged share, so the
  bar catches it; a step made longer (by the system or the host) lowers the compute share itself,
  which only the shown measured / nominal row reveals. A slot skipped in every run (its shaped link
  needs root) is shown with the reason, not judged;
* shown per slot: the same over the *nominal* compute share (speed x time up). On this 2-core host
  an emulated slow learner computes less than its nominal share: it sleeps (1/speed - 1) x its
  measured step time, and its short compute bursts always compete with every full-speed learner,
  while a full-speed learner competes with the slow one only a tenth of the time (docs/chaos.md,
  "Heterogeneous fleets"). Its measured share over its nominal share is shown too, and so are the
  share of its time up it spent inside steps and its merged share over its processed share (of
  what it computed, how much reached the model);
* the run's compute goodput in compute actually available (useful compute seconds x speed over
  up seconds x speed, ``speed_weighted_compute_goodput``) over the full-speed run's of the same seed
  >= 0.9;
* shown: both runs' compute and token goodput.

Each figure is the mean over the seeds with its 95% t-interval (benchmarks/stats.py). Exit status 1
when a bar is missed or a figure is missing, 2 on bad arguments (files that are not the scenario's,
seeds that do not pair up).

Usage: python -m benchmarks.het_bars --het H0.json H1.json H2.json --full F0.json F1.json F2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.args import description
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_over_runs
from diloco_async.chaos.measure import processed_shares

__all__ = ["het_bars", "main", "MERGED_OVER_COMPUTE_MIN", "GOODPUT_RATIO_MIN"]

#: a learner's merged share of the tokens over its compute share: at least this
MERGED_OVER_COMPUTE_MIN = 0.8
#: the mixed fleet's compute goodput (in compute available) over the full-speed fleet's: at least this
GOODPUT_RATIO_MIN = 0.9


def _decoupled(path: str) -> tuple[dict, dict]:
    """The file's document and its ``decoupled`` row.

    Raises:
        ValueError: no such row, or the row has no per-learner shares (an older harness).
    """
    doc = json.loads(Path(path).read_text())
    rows = {r["method"]: r for r in doc.get("rows", [])}
    if "decoupled" not in rows:
        raise ValueError(f"{path}: no 'decoupled' row (methods {sorted(rows)})")
    if not rows["decoupled"].get("learners"):
        raise ValueError(f"{path}: the decoupled row has no per-learner shares ('learners')")
    if any("capacity_share" not in ln for ln in rows["decoupled"]["learners"]):
        raise ValueError(f"{path}: the learners have no measured compute share ('capacity_share'): "
                         "written by an older harness, run the scenario again")
    return doc, rows["decoupled"]


def _by_seed(paths: list[str], full_speed: bool) -> dict[int, tuple[dict, dict]]:
    out: dict[int, tuple[dict, dict]] = {}
    for p in paths:
        doc, row = _decoupled(p)
        if bool(doc.get("full_speed")) != full_speed:
            raise ValueError(f"{p}: full_speed is {doc.get('full_speed')}, expected {full_speed}")
        seed = int(doc["seed"])
        if seed in out:
            raise ValueError(f"{p}: seed {seed} appears twice")
        out[seed] = (doc, row)
    return out


def _slot_label(ln: dict) -> str:
    note = ln.get("note") or ""
    return f"slot {ln['slot']} ({ln['speed']:g}x{', ' + note if note and not ln.get('skipped') else ''})"


def het_bars(het_paths: list[str], full_paths: list[str]) -> list[Bar]:
    """The bars of the runs in ``het_paths`` against their full-speed baselines in ``full_paths``
    (module docstring).

    Raises:
        ValueError: no files, a file without a decoupled row or shares, a baseline that is not one
            (or a scenario run that is), the two sets' seeds or scenarios differ.
    """
    if not het_paths or not full_paths:
        raise ValueError("need at least one --het and one --full file")
    het, full = _by_seed(het_paths, False), _by_seed(full_paths, True)
    if sorted(het) != sorted(full):
        raise ValueError(f"seeds differ: scenario runs {sorted(het)}, full-speed runs {sorted(full)}")
    names = {doc["scenario"] for doc, _ in [*het.values(), *full.values()]}
    if len(names) != 1:
        raise ValueError(f"the files are of different scenarios: {sorted(names)}")
    seeds = sorted(het)
    bars: list[Bar] = []
    slots = [ln["slot"] for ln in het[seeds[0]][1]["learners"]]
    for slot_index, slot in enumerate(slots):
        lns = [next(ln for ln in het[s][1]["learners"] if ln["slot"] == slot) for s in seeds]
        label = _slot_label(lns[0])
        if all(ln.get("skipped") for ln in lns):
            bars.append(Bar(f"{label}: merged share / compute share", None, MERGED_OVER_COMPUTE_MIN,
                            detail=f"skipped: {lns[0]['skipped']}", shown=True))
            continue
        value, detail = mean_over_runs([ln["merged_over_capacity"] for ln in lns])
        merged = ", ".join(f"{ln['tokens_merged']:.0f}" for ln in lns)
        bars.append(Bar(f"{label}: merged share / compute share", value, MERGED_OVER_COMPUTE_MIN,
                        detail=f"{detail}; compute share {lns[0]['capacity_share']:.3f}; tokens merged {merged}"))
        for key, name in (("merged_over_compute", "merged share / nominal compute share"),
                          ("capacity_over_compute", "compute share / nominal (speed x time up)"),
                          ("stepping_over_up", "share of its time up spent stepping")):
            value, detail = mean_over_runs([ln[key] for ln in lns])
            bars.append(Bar(f"{label}: {name}", value, 0.0, detail=detail, shown=True))
        shares = [processed_shares(het[s][1]["learners"])[slot_index] for s in seeds]
        value, detail = mean_over_runs([ln["merged_share"] / sh if ln["merged_share"] is not None and sh else None
                                        for ln, sh in zip(lns, shares, strict=True)])
        bars.append(Bar(f"{label}: merged share / processed share", value, 0.0,
                        detail=f"{detail}; share of tokens processed {shares[0]:.3f}", shown=True))
    ratios = []
    for s in seeds:
        h, f = het[s][1]["speed_weighted_compute_goodput"], full[s][1]["speed_weighted_compute_goodput"]
        ratios.append(h / f if f > 0 else None)
    value, detail = mean_over_runs(ratios)
    bars.append(Bar("compute goodput in compute available / full-speed fleet's", value, GOODPUT_RATIO_MIN,
                    detail=detail))
    for what, runs in (("mixed fleet", het), ("full-speed fleet", full)):
        for key, name in (("speed_weighted_compute_goodput", "compute goodput in compute available"),
                          ("token_goodput", "token goodput")):
            value, detail = mean_over_runs([runs[s][1][key] for s in seeds])
            bars.append(Bar(f"{what}: {name}", value, 0.0, detail=detail, shown=True))
    return bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.het_bars", description=description(__doc__))
    parser.add_argument("--het", nargs="+", required=True, metavar="FILE",
                        help="chaos --out files of configs/chaos/heterogeneous.toml, one per seed")
    parser.add_argument("--full", nargs="+", required=True, metavar="FILE",
                        help="the same with --full-speed, the same seeds")
    args = parser.parse_args(argv)
    try:
        bars = het_bars(args.het, args.full)
    except (ValueError, KeyError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return print_bars(bars, out=sys.stdout, title="heterogeneous fleet (configs/chaos/heterogeneous.toml, issue 47)")


if __name__ == "__main__":
    sys.exit(main())
