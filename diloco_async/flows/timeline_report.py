"""Drawings of goodput timelines (matplotlib): one row per learner slot, its states over time and
the merges of the global model; and the timeline of an ordinary training run, rebuilt from what
its processes recorded (:mod:`diloco_async.metrics.run_timeline`), drawn and accounted.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping
from pathlib import Path

from diloco_async.config.schema import Config
from diloco_async.metrics.run_timeline import fragment_shares, read_merges, timeline_from_records
from diloco_async.metrics.timeline import Accounting, Timeline, account, read_records
from diloco_async.storage.store import ObjectStore

__all__ = ["goodput_subtitle", "plot_timeline", "write_run_timeline"]


_COLOURS = {"useful": "#2e8b57", "thrown away": "#c0392b", "down": "#404040", "starting": "#f5cba7",
            "restarting": "#e67e22",
            "stalled": "#8e44ad", "blocked": "#95a5a6"}


def plot_timeline(tl: Timeline, path: str | os.PathLike, title: str = "", mark_s: float | None = None,
                  subtitle: str = "") -> None:
    """Draw each slot's states over time and the merges of the global model into a PNG.

    One row per learner: useful steps green, thrown-away steps red, down dark grey, starting
    (the slot's first start-up) light orange, restarting (a later one) orange, stalled purple,
    blocked light grey; merges are ticks on a row of their own at the top.
    Times are shown in seconds from ``tl.start_s``; ``mark_s`` (same clock) draws a dashed line,
    e.g. where the goodput window starts. ``subtitle`` is printed under the title, wrapped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = list(tl.learners)
    heading = title or "learner timeline"
    if subtitle:
        heading += "\n" + textwrap.fill(subtitle, 150)
    head_in = 0.17 * heading.count("\n")  # inches for the lines under the title
    fig, ax = plt.subplots(figsize=(12, 1.6 + head_in + 0.45 * (len(rows) + 1)), dpi=100)
    t0 = tl.start_s
    for i, lid in enumerate(rows):
        y = len(rows) - i
        bars: dict[str, list[tuple[float, float]]] = {k: [] for k in _COLOURS}
        for iv in tl.intervals:
            if iv.learner == lid:
                bars[iv.state].append((iv.t0 - t0, iv.t1 - iv.t0))
        for st in tl.steps:
            if st.learner != lid:
                continue
            dur = st.t1 - st.t0
            if st.useful > 0:
                bars["useful"].append((st.t0 - t0, dur * st.useful))
            if st.useful < 1:
                bars["thrown away"].append((st.t0 - t0 + dur * st.useful, dur * (1 - st.useful)))
        for state in ("useful", "thrown away", "blocked", "starting", "restarting", "stalled", "down"):
            if bars[state]:
                ax.broken_barh(bars[state], (y - 0.35, 0.7), facecolors=_COLOURS[state], linewidth=0)
    top = len(rows) + 1
    if tl.merges_s:
        ax.vlines([m - t0 for m in tl.merges_s], top - 0.35, top + 0.35, colors="#1f4e79", linewidth=0.6)
    if mark_s is not None:
        ax.axvline(mark_s - t0, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(list(range(1, top + 1)), list(reversed(rows)) + ["merges"])
    ax.set_xlim(0, max(1e-9, tl.end_s - t0))
    ax.set_xlabel("seconds since start")
    ax.set_title(heading, fontsize=9 if subtitle else None)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()], loc="lower center",
               ncol=len(_COLOURS), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # the legend's row below the axis
    fig.savefig(path)
    plt.close(fig)


def goodput_subtitle(acc: Accounting, ledger: Mapping[str, float] | None) -> str:
    """What the timeline's compute goodput is, and why it differs from the run's (the
    synchronizer's ledger, DESIGN §7; ``ledger`` holds its ``compute_goodput``, ``useful_s`` and
    ``provisioned_s``, as the run summary does): the two count over different windows."""
    d = acc.to_json()
    text = (f"this timeline: compute goodput {acc.compute_goodput:.3f} = {d['useful_s']:.1f} useful / "
            f"{d['provisioned_s']:.1f} provisioned learner-s, every slot from the first learner's process start to "
            f"the last learner record (a slot that started later is down until then)")
    if ledger is None:
        return text + "."
    return text + (f"; the run's compute goodput (summary, DESIGN §7): {float(ledger['compute_goodput']):.3f} = "
                   f"{float(ledger['useful_s']):.1f} / {float(ledger['provisioned_s']):.1f} learner-s, each slot from "
                   f"its own process start to the synchronizer's summary, useful time as the learners timed "
                   f"their merged contributions.")


def write_run_timeline(cfg: Config, store: ObjectStore, run_id: str, epoch: str, timeline_dir: Path,
                       png: Path, max_gap_s: float, ledger: Mapping[str, float] | None = None) -> dict | None:
    """Rebuild the timeline of one synchronizer epoch, draw it to ``png`` (its subtitle:
    :func:`goodput_subtitle` against ``ledger``, the run summary) and return its accounting
    (``Accounting.to_json``); None when no learner recorded anything."""
    records = {p.stem: read_records(p) for p in sorted(Path(timeline_dir).glob("*.jsonl"))}
    records = {k: v for k, v in records.items() if any(r["kind"] == "start" for r in v)}
    if not records:
        return None
    tl = timeline_from_records(records, read_merges(store, run_id, epoch), fragment_shares(cfg))
    acc = account(tl, max_gap_s)
    plot_timeline(tl, png, title=f"run {run_id}: learner timeline, compute goodput {acc.compute_goodput:.3f}",
                  subtitle=goodput_subtitle(acc, ledger))
    return acc.to_json()
