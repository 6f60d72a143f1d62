"""`diloco-async status <sync-url>`: the synchronizer's /status as tables (learners, rounds)."""

from __future__ import annotations

import signal
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from diloco_async.protocol.client import fetch_status

__all__ = ["fetch_status", "render_status", "main"]


def budget_progress(st: dict) -> str:
    """How far the run is through each budget it has, e.g. ``tokens 41% · wall 12%``."""
    budget, parts = st.get("budget") or {}, []
    for name, key, done in (("tokens", "tokens", st.get("tokens_processed")), ("steps", "max_steps",
                                                                               st.get("global_step")),
                            ("wall", "wall_s", st.get("wall_s"))):
        if budget.get(key) and done is not None:
            parts.append(f"{name} {100 * done / budget[key]:.0f}%")
    return " · ".join(parts) or "-"


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _per_token(up: float | None, down: float | None) -> str:
    return " / ".join("-" if x is None else f"{x:.2f}" for x in (up, down))


def _link(info: dict) -> str:
    """``link-bound: needs X s per fragment, has Y s`` (red), ``ok X / Y s``, or ``-``."""
    need, budget = info.get("link_s_per_fragment"), info.get("link_budget_s")
    if need is None or budget is None:
        return "-"
    if info.get("link_bound"):
        return f"[red]link-bound: needs {need:.3f} s per fragment, has {budget:.3f} s[/red]"
    return f"ok {need:.3f} / {budget:.3f} s"


def render_status(st: dict) -> Group:
    """Tables of the run figures (budget, bytes, rejections by reason), the learners (with the
    seconds since each was last heard from) and the open rounds."""
    head = Table(title=f"run {st['run_id']} — {'stopping: ' + st['stopping'] if st.get('stopping') else 'training'}")
    for col in ("wall s", "budget", "global step", "merges", "merged / late / rejected", "compute goodput",
                "token goodput", "bytes in / out", "B/token up / down"):
        head.add_column(col, justify="right")
    head.add_row(f"{st['wall_s']:.0f}", budget_progress(st), str(st.get("global_step")), str(st["merges"]),
                 f"{st['contributions_merged']} / {st['contributions_late']} / {st['contributions_rejected']}",
                 f"{st['compute_goodput']:.3f}", f"{st['token_goodput']:.3f}",
                 f"{_bytes(st.get('bytes_in'))} / {_bytes(st.get('bytes_out'))}",
                 _per_token(st.get("bytes_up_per_token"), st.get("bytes_down_per_token")))
    learners = Table(title="learners")
    for col in ("learner", "state", "last heard", "step", "incarnation", "tokens", "merged", "late", "rejected",
                "goodput", "B/token up / down", "link"):
        learners.add_column(col, justify="right" if col not in ("learner", "state") else "left",
                            no_wrap=col == "learner", min_width=len("learner-00") if col == "learner" else None)
    for lid, info in sorted(st["learners"].items()):
        c = info.get("contributions", {})
        age = info.get("heartbeat_age_s")
        learners.add_row(lid, "live" if info["live"] else "[red]lost[/red]", "-" if age is None else f"{age:.1f}s ago",
                         str(info["step"]), str(info["incarnation"]), str(info["tokens_processed"]),
                         str(c.get("merged", 0)), str(c.get("late", 0)), str(c.get("rejected", 0)),
                         f"{info['compute_goodput']:.3f}",
                         _per_token(info.get("bytes_up_per_token"), info.get("bytes_down_per_token")), _link(info))
    rounds = Table(title="open rounds")
    for col in ("fragment", "round", "stage", "announced", "verified"):
        rounds.add_column(col)
    for r in st.get("rounds", []):
        rounds.add_row(str(r["fragment"]), str(r["round"]), r["stage"], ", ".join(r["announced"]),
                       ", ".join(r["verified"]))
    versions = ", ".join(f"p{p}: v{v}" for p, v in sorted(st["versions"].items(), key=lambda kv: int(kv[0])))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(st.get("rejected_by_reason", {}).items())) or "none"
    return Group(head, learners, rounds, f"versions  {versions}", f"rejected by reason  {reasons}")


def main(url: str, watch: bool = False, interval_s: float = 2.0) -> int:
    """``diloco-async status``: print the synchronizer's view once, or with ``watch`` refresh it every
    ``interval_s`` until the run ends (in place on a terminal; one table per refresh when the output
    is a pipe or a file). Ctrl-C (exit status 130) or SIGTERM (143) stops watching with one line,
    also when the command was started with SIGINT ignored (a background job of a script inherits
    that), as ``train`` does. Must be called from the main thread (it sets both handlers)."""
    console = Console()
    try:
        st = fetch_status(url)
    except OSError as err:
        console.print(f"[red]error:[/red] no answer from {url}/status ({err})")
        return 2
    if not watch:
        console.print(render_status(st))
        return 0
    signals: list[int] = []

    def _stop(signum: int, _frame) -> None:  # Ctrl-C or SIGTERM: stop watching
        signals.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(console, url, st, interval_s)
    except KeyboardInterrupt:
        console.print("stopped watching (the run goes on)")
        return 143 if signals and signals[0] == signal.SIGTERM else 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
