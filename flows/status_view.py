"""`diloco-async status <sync-url>`: the synchronizer's /status as tables (learners, rounds)."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from diloco_async.client import fetch_status

__all__ = ["fetch_status", "render_status", "main"]


def render_status(st: dict) -> Group:
    """Tables of the run figures, the learners and the open rounds."""
    head = Table(title=f"run {st['run_id']} — {'stopping: ' + st['stopping'] if st.get('stopping') else 'training'}")
    for col in ("wall s", "global step", "merges", "merged / late / rejected", "compute goodput", "token goodput"):
        head.add_column(col, justify="right")
    head.add_row(f"{st['wall_s']:.0f}", str(st.get("global_step")), str(st["merges"]),
                 f"{st['contributions_merged']} / {st['contributions_late']} / {st['contributions_rejected']}",
                 f"{st['compute_goodput']:.3f}", f"{st['token_goodput']:.3f}")
    learners = Table(title="learners")
    for col in ("learner", "state", "step", "incarnation", "tokens", "merged", "late", "rejected", "goodput"):
        learners.add_column(col, justify="right" if col not in ("learner", "state") else "left")
    for lid, info in sorted(st["learners"].items()):
        c = info.get("contributions", {})
        learners.add_row(lid, "live" if info["live"] else "[red]lost[/red]", str(info["step"]),
                         str(info["incarnation"]), str(info["tokens_processed"]), str(c.get("merged", 0)),
                         str(c.get("late", 0)), str(c.get("rejected", 0)), f"{info['compute_goodput']:.3f}")
    rounds = Table(title="open rounds")
    for col in ("fragment", "round", "stage", "announced", "verified"):
        rounds.add_column(col)
    for r in st.get("rounds", []):
        rounds.add_row(str(r["fragment"]), str(r["round"]), r["stage"], ", ".join(r["announced"]),
                       ", ".join(r["verified"]))
    versions = ", ".join(f"p{p}: v{v}" for p, v in sorted(st["versions"].items(), key=lambda kv: int(kv[0])))
    return Group(head, learners, rounds, f"versions  {versions}")


def main(url: str, watch: bool = False, interval_s: float = 2.0) -> int:
    """``diloco-async status``: print the synchronizer's view once, or with ``watch`` refresh it every
    ``interval_s`` until the run ends (in place on a terminal; one table per refresh when the output
    is a pipe or a file). Ctrl-C stops watching with one line and exit status 130."""
    console = Console()
    try:
        st = fetch_status(url)
    except OSError as err:
        console.print(f"[red]error:[/red] no answer from {url}/status ({err})")
        return 2
    if not watch:
        console.print(render_status(st))
        return 0
    try:
        return _watch(console, url, st, interval_s)
    except KeyboardInterrupt:
        console.print("stopped watching (the run goes on)")
        return 130


def _watch(console: Console, url: str, st: dict, interval_s: float) -> int:
    live = Live(render_status(st), console=console, refresh_per_second=4) if console.is_terminal else None
    if live is None:
        console.print(render_status(st))
    else:
        live.start()
    try:
        while not st.get("finished"):
            time.sleep(interval_s)
            try:
                st = fetch_status(url)
            except OSError:
                console.print("synchronizer gone")
                return 0
            if live is None:
                console.print(render_status(st))
            else:
                live.update(render_status(st))
    finally:
        if live is not None:
            live.stop()
    return 0
