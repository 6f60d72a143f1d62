"""The report of an ablation suite: a markdown table, bar charts with 95% intervals (PNG) and the
same table in the terminal (rich)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from diloco_async.ablation.analysis import Analysis, ArmFigure, ComparisonRow  # noqa: E402
from diloco_async.ablation.stats import Interval  # noqa: E402
from diloco_async.ablation.suite import LOWER_IS_BETTER, Suite  # noqa: E402

__all__ = ["write_report", "rows_of", "print_table", "markdown"]

_COLOURS = {"reproduced": "green", "not reproduced": "red", "inconclusive": "yellow"}


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def _mean_pm(f: ArmFigure) -> str:
    if f.t is None:
        return "no runs"
    if f.t.n < 2:
        return f"{_num(f.t.mean)} (1 run)"
    return f"{_num(f.t.mean)} ± {_num(f.t.half_width)}"


def _diff(d: Interval | None) -> str:
    if d is None:
        return "n/a"
    return f"{_num(d.mean)} [{_num(d.low)}, {_num(d.high)}] ({d.method}, n={d.n})"


def _claim(r: ComparisonRow) -> str:
    margin = f", margin {_num(r.margin)}" if r.expect in ("equivalent", "not-higher", "not-lower") else ""
    return f"{r.b} − {r.a}: {r.expect}{margin}"


def rows_of(analysis: Analysis) -> list[dict]:
    """One JSON-ready dict per comparison: names, the paper's statement, both arms' mean and t
    interval, the difference ``b - a`` with its interval, the claim and the verdict."""
    out = []
    for r in analysis.rows:
        d = r.diff
        out.append({"comparison": r.name, "figure": r.figure, "paper": r.paper, "a": r.a, "b": r.b,
                    "a_mean_pm": _mean_pm(r.arm_a), "b_mean_pm": _mean_pm(r.arm_b),
                    "a_t": r.arm_a.t.to_json() if r.arm_a.t else None,
                    "b_t": r.arm_b.t.to_json() if r.arm_b.t else None,
                    "diff_mean": d.mean if d else None, "diff_low": d.low if d else None,
                    "diff_high": d.high if d else None, "diff_method": d.method if d else None,
                    "diff_n": d.n if d else 0, "diff": _diff(d), "claim": _claim(r), "expect": r.expect,
                    "margin": r.margin, "verdict": r.verdict, "why": r.why})
    return out


def markdown(sp: Suite, analysis: Analysis, rows: list[dict], charts: list[Path]) -> str:
    """The report as markdown: the comparisons with verdicts, then every arm's figures."""
    s = sp.suite
    lines = [f"# Ablation suite `{s.name}`", "", s.description, "",
             f"{len(sp.arms)} arms x {len(s.seeds)} seeds {s.seeds}, {s.tokens:,} tokens per run, "
             f"{analysis.runs} runs recorded; means ± half-width of the {s.confidence:.0%} t interval; "
             "differences b − a paired by seed.", "",
             "| comparison | figure | paper | a: mean ± CI | b: mean ± CI | b − a [CI] | claim | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = r["verdict"] + (f" ({r['why']})" if r["why"] else "")
        lines.append(f"| {r['comparison']} | {r['figure']} | {r['paper']} | {r['a']}: {r['a_mean_pm']} | "
                     f"{r['b']}: {r['b_mean_pm']} | {r['diff']} | {r['claim']} | **{verdict}** |")
    lines += ["", "## Every arm", "", "| arm | " + " | ".join(s.figures) + " |",
              "|---|" + "---|" * len(s.figures)]
    for arm in sp.arms:
        cells = []
        for fig in s.figures:
            f = analysis.arms[(arm.name, fig)]
            boot = f" (bootstrap [{_num(f.bootstrap.low)}, {_num(f.bootstrap.high)}])" \
                if f.bootstrap and f.bootstrap.n > 1 else ""
            cells.append(f"{_mean_pm(f)}{boot} n={len(f.values)}")
        lines.append(f"| {arm.name} | " + " | ".join(cells) + " |")
    if analysis.missing:
        lines += ["", "Runs without a record: " + ", ".join(f"{a} seed {x}" for a, x in analysis.missing)]
    lines += ["", f"Budget: {s.tokens_why}", ""] + [f"![{c.stem}](charts/{c.name})" for c in charts]
    return "\n".join(lines) + "\n"


def _chart(sp: Suite, analysis: Analysis, figure: str, path: Path) -> Path | None:
    """Bars of one figure per arm (mean), 95% t-interval error bars, one dot per seed."""
    arms = [a.name for a in sp.arms if analysis.arms[(a.name, figure)].t is not None]
    if not arms:
        return None
    fs = [analysis.arms[(a, figure)] for a in arms]
    means = [f.t.mean for f in fs]
    errs = [f.t.half_width if math.isfinite(f.t.half_width) else 0.0 for f in fs]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(arms) + 1.5), 3.6))
    ax.bar(range(len(arms)), means, yerr=errs, capsize=6, color="#8fb3d9", edgecolor="#2b4a6f")
    for i, f in enumerate(fs):
        ax.scatter([i] * len(f.values), list(f.values.values()), s=12, color="#2b4a6f", zorder=3)
    lo = min(min(f.values.values()) for f in fs)
    hi = max(max(f.values.values()) for f in fs)
    pad = (hi - lo) * 0.6 or abs(hi) * 0.05 or 1.0
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xticks(range(len(arms)), arms)
    better = "lower" if figure in LOWER_IS_BETTER else "higher"
    ax.set_title(f"{sp.suite.name}: {figure} ({better} is better), mean and 95% interval", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(sp: Suite, analysis: Analysis, outdir: Path) -> tuple[Path, list[Path], list[dict]]:
    """Write ``{outdir}/report.md`` and ``{outdir}/charts/{figure}.png``; returns (markdown path,
    chart paths, rows of :func:`rows_of`)."""
    (outdir / "charts").mkdir(parents=True, exist_ok=True)
    charts = [c for fig in sp.suite.figures if (c := _chart(sp, analysis, fig, outdir / "charts" / f"{fig}.png"))]
    rows = rows_of(analysis)
    md = outdir / "report.md"
    md.write_text(markdown(sp, analysis, rows, charts))
    return md, charts, rows


def print_table(suite: str, rows: list[dict], console: Console | None = None) -> None:
    """The comparisons with their verdicts as a rich table."""
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    t = Table(title=f"ablation suite {suite}: b − a, paired by seed, 95% interval")
    for col in ("comparison", "figure", "paper", "a: mean ± CI", "b: mean ± CI", "b − a [CI]", "claim", "verdict"):
        t.add_column(col)
    for r in rows:
        colour = _COLOURS.get(r["verdict"], "white")
        t.add_row(r["comparison"], r["figure"], r["paper"], f"{r['a']}: {r['a_mean_pm']}",
                  f"{r['b']}: {r['b_mean_pm']}", r["diff"], r["claim"], f"[{colour}]{r['verdict']}[/{colour}]")
    console.print(t)
