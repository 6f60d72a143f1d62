"""``diloco-async simulate``: goodput at paper scale from the command line.

Examples::

    diloco-async simulate --grid paper-table1            # Table 1, side by side with the paper
    diloco-async simulate --grid heterogeneity           # paper §6.5, K = 8 vs K = 1
    diloco-async simulate --chips 1200000 --learners 8   # one question, every method
    diloco-async simulate --chips 600000 --learners 4 --method diloco --quorum 2 --mtbi-years 0.5 --json

The numbers come from :mod:`diloco_async.sim`; MLflow and matplotlib are imported only with
``--mlflow`` (``diloco_async/flows/simulate.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from diloco_async.sim import (
    METHODS,
    TABLE1_CHIPS,
    CellResult,
    Scenario,
    heterogeneity_scenarios,
    paper_goodput,
    paper_table1_scenarios,
    simulate_many,
)
from diloco_async.sim.calibration import Calibration, default_calibration_path, load_calibration

__all__ = ["main", "build_parser", "scenarios_from_args", "format_table1", "format_cells"]

GRIDS = ("paper-table1", "heterogeneity")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diloco-async simulate",
        description="Goodput of data-parallel and Decoupled DiLoCo training under chip failures "
        "(discrete-event simulation, paper §5). Without --grid or --chips: --grid paper-table1.",
    )
    p.add_argument("--grid", choices=GRIDS, help="a paper grid, printed next to the paper's numbers")
    p.add_argument("--chips", type=int, nargs="+", metavar="N", help="total chips (one or more)")
    p.add_argument(
        "--learners", type=int, nargs="+", metavar="M",
        help="Decoupled DiLoCo learners (one or more; default 8)",
    )
    p.add_argument("--quorum", type=int, default=1, metavar="K", help="minimum quorum K (default 1)")
    p.add_argument(
        "--mtbi-years", "--mtbi", type=float, default=None, metavar="Y",
        help="mean time between interruptions per chip, years (default: the calibration's)",
    )
    p.add_argument(
        "--method", choices=(*METHODS, "all"), default="all",
        help="dp (no elasticity), dp-elastic, diloco, or all (default)",
    )
    p.add_argument("--calibration", type=Path, default=None, metavar="PATH",
                   help="calibration file (default configs/calibration.toml)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the cells as a JSON list")
    p.add_argument("--mlflow", action="store_true",
                   help="log the results and a goodput-vs-chips plot to MLflow")
    p.add_argument("--mlflow-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else "
                        "sqlite:///.local/mlflow.db as `make ui`)")
    p.add_argument("--experiment", default="simulate", help="MLflow experiment (default simulate)")
    return p


def scenarios_from_args(args: argparse.Namespace, cal: Calibration) -> list[Scenario]:
    """The scenarios a parsed command line asks for.

    Raises:
        ValueError: conflicting or out-of-range flags (message names the flag).
    """
    mtbi = args.mtbi_years if args.mtbi_years is not None else cal.failures.mtbi_chip_years
    if args.grid and args.chips:
        raise ValueError("give either --grid or --chips, not both")
    if args.grid == "heterogeneity":
        return heterogeneity_scenarios(cal)
    if args.grid == "paper-table1" or not args.chips:
        return paper_table1_scenarios(mtbi_years=mtbi)
    questions: list[tuple[str, int, int, int]] = []  # method, chips, learners, quorum
    per_slice = cal.slices.chips_per_slice
    for m in args.learners or [8]:
        if m < 1:
            raise ValueError(f"--learners must be >= 1, got {m}")
    for chips in args.chips:
        smallest = per_slice * max(args.learners or [8]) if args.method in ("diloco", "all") else per_slice
        if chips < smallest:
            raise ValueError(f"--chips {chips} is too few: every learner needs at least one slice of "
                             f"{per_slice} chips ({smallest} for the learners asked)")
        if args.method in ("dp", "all"):
            questions.append(("dp", chips, 1, 1))
        if args.method in ("dp-elastic", "all"):
            questions.append(("dp-elastic", chips, 1, 1))
        if args.method in ("diloco", "all"):
            for m in args.learners or [8]:
                if not 1 <= args.quorum <= m:
                    raise ValueError(f"--quorum {args.quorum} must be in 1..--learners {m}")
                questions.append(("diloco", chips, m, args.quorum))
    return [
        Scenario(method, chips, learners=m, quorum=k, mtbi_years=mtbi,  # type: ignore[arg-type]
                 paper=paper_goodput(method, chips, m, k, mtbi))
        for method, chips, m, k in questions
    ]


def _chips_label(chips: int) -> str:
    if chips >= 1_000_000 and chips % 100_000 == 0:
        return f"{chips / 1e6:g}M"
    if chips >= 1000 and chips % 1000 == 0:
        return f"{chips // 1000}k"
    return str(chips)


def _points(diff: float) -> float:
    """A difference of fractions in percentage points, rounded to 0.1 (never printed as -0.0)."""
    return round(100 * diff, 1) + 0.0


def format_table1(results: Sequence[CellResult]) -> str:
    """Table 1 as text: per cell simulated %, paper %, difference in points; then a summary."""
    rows: dict[str, dict[int, CellResult]] = {}
    for r in results:
        rows.setdefault(r.scenario.label, {})[r.scenario.chips] = r
    head = f"{'method':<18}" + "".join(f"{_chips_label(c):>22}" for c in TABLE1_CHIPS)
    sub = f"{'':<18}" + f"{'sim':>9}{'paper':>6}{'diff':>7}" * len(TABLE1_CHIPS)
    lines = [head, sub]
    for label, cells in rows.items():
        parts = []
        for c in TABLE1_CHIPS:
            r = cells[c]
            paper = r.scenario.paper or 0.0
            parts.append(f"{100 * r.goodput:>9.1f}{100 * paper:>6.0f}{_points(r.goodput - paper):>+7.1f}")
        lines.append(f"{label:<18}" + "".join(parts))
    worst = max(abs(r.goodput - (r.scenario.paper or 0.0)) for r in results)
    in_order = sum(_column_order_matches(rows, c) for c in TABLE1_CHIPS)
    lines.append(
        f"max |diff| {100 * worst:.1f} points; method order matches the paper in "
        f"{in_order}/{len(TABLE1_CHIPS)} columns"
    )
    return "\n".join(lines)


def _column_order_matches(rows: dict[str, dict[int, CellResult]], chips: int) -> bool:
    cells = [cells[chips] for cells in rows.values()]
    by_sim = sorted(cells, key=lambda r: r.goodput)
    by_paper = sorted(cells, key=lambda r: r.scenario.paper or 0.0)
    return [r.scenario.label for r in by_sim] == [r.scenario.label for r in by_paper]


def format_cells(results: Sequence[CellResult]) -> str:
    """Any list of cells as a text table (the paper's value and difference when known)."""
    lines = [
        f"{'method':<22}{'chips':>10}{'M':>4}{'K':>4}{'MTBI y':>8}{'goodput %':>11}{'uptime %':>10}"
        f"{'failures':>10}{'paper %':>9}{'diff':>7}"
    ]
    for r in results:
        s = r.scenario
        paper = f"{100 * s.paper:>9.0f}{_points(r.goodput - s.paper):>+7.1f}" if s.paper is not None else ""
        mtbi = f"{s.mtbi_years:g}" if s.mtbi_years != float("inf") else "none"
        lines.append(
            f"{s.label:<22}{s.chips:>10}{s.learners:>4}{s.quorum:>4}{mtbi:>8}"
            f"{100 * r.goodput:>11.1f}{100 * r.uptime:>10.1f}{r.failures:>10}{paper}"
        )
    return "\n".join(lines)


def _describe_heterogeneity(cal: Calibration) -> str:
    h = cal.heterogeneity
    return (
        f"Heterogeneity (paper §6.5): M={h.learners}, {h.learners - h.slow_learners} learners at "
        f"step x1.00 and {h.slow_learners} at x{h.slow_step_factor:.2f}, "
        f"{100 * h.learner_step_noise:.0f}% step-time noise, "
        f"{'with' if h.with_failures else 'no'} failures"
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``diloco-async simulate``; ``argv`` is the command line after ``simulate``.

    Returns 0; bad flags or a bad calibration file exit with status 2 and a message (argparse).
    """
    out = sys.stdout
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    cal_path = args.calibration or default_calibration_path()
    try:
        cal = load_calibration(cal_path)
        scenarios = scenarios_from_args(args, cal)
    except ValueError as e:
        parser.error(str(e))
    grid = args.grid or ("paper-table1" if not args.chips else None)
    t0 = time.perf_counter()
    results = simulate_many(scenarios, cal, seed=args.seed)
    elapsed_s = time.perf_counter() - t0

    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2), file=out)
    else:
        days = cal.run.horizon_s / 86400
        if grid == "paper-table1":
            versus = "simulated vs paper" if scenarios[0].paper is not None else "simulated"
            print(f"Paper Table 1 grid: goodput (%), {versus}, MTBI "
                  f"{scenarios[0].mtbi_years:g} chip-year", file=out)
        elif grid == "heterogeneity":
            print(_describe_heterogeneity(cal), file=out)
        print(f"calibration {cal_path}, seed {args.seed}, {days:g} simulated days per cell, "
              f"{len(results)} cells in {elapsed_s:.1f} s", file=out)
        full_table1 = grid == "paper-table1" and all(r.scenario.paper is not None for r in results)
        print(format_table1(results) if full_table1 else format_cells(results), file=out)

    if args.mlflow:
        from diloco_async.flows.simulate import log_results  # lazy: MLflow and matplotlib only when asked

        run_id = log_results(
            results, grid=grid or "question", calibration_path=Path(cal_path), calibration=cal,
            seed=args.seed, elapsed_s=elapsed_s, tracking_uri=args.mlflow_uri,
            experiment=args.experiment,
        )
        print(f"logged to MLflow run {run_id}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
