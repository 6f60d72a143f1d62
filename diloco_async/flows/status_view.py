"""`diloco-async status <sync-url>`: the synchronizer's /status as tables (the run, learners, open
rounds and recent merges) in 100 columns; ``--wide`` adds what does not fit (bytes per token per
learner, link figures, the learner ids of each round). With synchronizer shards (the shards' URLs
comma-separated, in shard order) the run's figures aggregated over them
(:func:`~diloco_async.metrics.shards.aggregate_status`) and a row per shard."""

from __future__ import annotations

import signal
import time
from collections import Counter

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from diloco_async.metrics.shards import aggregate_status
from diloco_async.protocol.client import fetch_status

__all__ = ["fetch_status", "fetch_run_status", "render_status", "main"]


def fetch_run_status(url: str) -> dict:
    """``GET /status`` of the synchronizer at ``url``, or of every shard of ``url`` = the shards' URLs
    comma-separated, aggregated (a shard that does not answer is a row marked unreachable).

    Raises:
        OSError: no shard answered (the message names every URL).
    """
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if len(urls) == 1:
        return fetch_status(urls[0])
    docs, errors = [], []
    for u in urls:
        try:
            docs.append(fetch_status(u))
        except (OSError, ValueError) as err:
            docs.append(None)
            errors.append(f"{u}: {err}")
    if all(d is None for d in docs):
        raise OSError("no synchronizer shard answered (" + "; ".join(errors) + ")")
    return aggregate_status(docs, urls)


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
    """Bytes in MiB, GiB or TiB (one decimal)."""
    if n is None:
        return "-"
    unit, size = next((u, s) for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)) if n >= s or u == "MiB")
    return f"{n / size:,.1f} {unit}"


def _per_token(up: float | None, down: float | None) -> str:
    return " / ".join("-" if x is None else f"{x:.2f}" for x in (up, down))


def _count(n: int | float | None) -> str:
    """A count in at most 6 characters: ``950``, ``162.8k``, ``12.3M``, ``4.1G``."""
    if n is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _link(info: dict, wide: bool) -> str:
    """``ok`` or ``bound`` (red: the link needs more seconds per fragment than the learner has),
    with both figures when ``wide``; ``-`` when not measured yet."""
    need, budget = info.get("link_s_per_fragment"), info.get("link_budget_s")
    if need is None or budget is None:
        return "-"
    if info.get("link_bound"):
        return (f"[red]link-bound: needs {need:.3f} s per fragment, has {budget:.3f} s[/red]" if wide
                else "[red]bound[/red]")
    return f"ok {need:.3f} / {budget:.3f} s" if wide else "ok"


def _table(title: str, columns: list[str], left: tuple[str, ...] = (), wrap: tuple[str, ...] = ()) -> Table:
    """A table without vertical rules (two spaces between columns), so that the tables fit 100
    columns; only the columns named in ``wrap`` wrap."""
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", no_wrap=col not in wrap)
    return table


def _run_figures(st: dict, wide: bool) -> Table:
    """The run as label / value lines (no table wider than its longest value)."""
    state = "stopping: " + st["stopping"] if st.get("stopping") else "training"
    versions = ", ".join(f"p{p}: v{v}" for p, v in sorted(st["versions"].items(), key=lambda kv: int(kv[0])))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(st.get("rejected_by_reason", {}).items())) or "none"
    per_token = _per_token(st.get("bytes_up_per_token"), st.get("bytes_down_per_token"))
    rows = [("run", f"{st['run_id']} ({state})"),
            ("progress", f"wall {st['wall_s']:.0f} s · global step {st.get('global_step')} · merges {st['merges']}"),
            ("budget", budget_progress(st)),
            ("contributions", f"{st['contributions_merged']} merged · {st['contributions_late']} late · "
                              f"{st['contributions_rejected']} rejected · {st.get('contributions_folded') or 0} "
                              "joined a later round"),
            ("rejected by reason", reasons),
            ("goodput", f"compute {st['compute_goodput']:.3f} · token {st['token_goodput']:.3f}"),
            ("traffic", f"{_bytes(st.get('bytes_in'))} in · {_bytes(st.get('bytes_out'))} out"),
            ("B/token up / down", per_token),
            ("versions", versions),
            ("network", _network(st))]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(max_width=None if wide else 80)
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def _network(st: dict) -> str:
    """Learners by network mode and the requests refused by mode, e.g. ``tls 4 · refused tls 3``."""
    modes = Counter(info.get("network_mode", "direct") for info in st["learners"].values())
    refused = st.get("refused_by_mode") or {}
    parts = [f"{m} {n}" for m, n in sorted(modes.items())] or ["no learner yet"]
    return " · ".join(parts + [f"refused {m} {n}" for m, n in sorted(refused.items())])


def _learners(st: dict, wide: bool) -> Table:
    columns = ["learner", "state", "last heard", "step", "incarnation", "tokens", "merged / late / rej", "goodput"]
    table = _table("learners", columns + (["B/token up / down"] if wide else []) + ["link"],
                   left=("learner", "state", "link"))
    for lid, info in sorted(st["learners"].items()):
        c = info.get("contributions", {})
        age = info.get("heartbeat_age_s")
        mode = f" {info.get('network_mode', 'direct')}" if wide else ""  # the run's figures sum the modes up
        row = [lid, ("live" if info["live"] else "[red]lost[/red]") + mode, "-" if age is None else f"{age:.1f} s",
               str(info["step"]), str(info["incarnation"]), _count(info["tokens_processed"]),
               f"{c.get('merged', 0)} / {c.get('late', 0)} / {c.get('rejected', 0)}", f"{info['compute_goodput']:.3f}"]
        if wide:
            row.append(_per_token(info.get("bytes_up_per_token"), info.get("bytes_down_per_token")))
        table.add_row(*row, _link(info, wide))
    return table


def _names(ids: list[str], wide: bool) -> str:
    """Learner ids when ``wide``, else their number (the ids can be long and many)."""
    return ", ".join(ids) or "-" if wide else str(len(ids))


def _rounds(st: dict, wide: bool) -> Table:
    """The open rounds (stage, seconds open, learners announced and verified), then the last merges
    (the version each made, its learners, how long ago): a round is open for a fraction of a second,
    so between two refreshes most have opened and merged already."""
    names = ("announced", "verified / merged")
    table = _table("open rounds and recent merges", ["fragment", "round", "state", *names, "when"],
                   left=("state", *names), wrap=names)
    for r in st.get("rounds", []):
        table.add_row(str(r["fragment"]), str(r["round"]), r["stage"], _names(r["announced"], wide),
                      _names(r["verified"], wide), f"open {r.get('open_s', 0.0):.1f} s")
    for m in st.get("recent_merges", []):
        table.add_row(str(m["fragment"]), str(m["round"]), f"merged: v{m['version']}", "",
                      _names(m["learners"], wide), f"{m['age_s']:.1f} s ago")
    return table


def _shards(st: dict) -> Table:
    """One row per synchronizer shard: answering or not, phase, merges, how many fragments it owns
    and their lowest and highest version, contributions late, last checkpoint (each fragment's
    version is in the run's figures)."""
    table = _table("synchronizer shards", ["shard", "state", "merges", "fragments", "versions", "late", "checkpoint"],
                   left=("state",))
    for row in st["shards"]:
        if not row.get("reachable"):
            table.add_row(str(row["shard"]), "[red]not answering[/red]", "-", "-", "-", "-", "-")
            continue
        versions = sorted((row.get("versions") or {}).values())
        span = "-" if not versions else f"v{versions[0]}" if versions[0] == versions[-1] else \
            f"v{versions[0]}-v{versions[-1]}"
        table.add_row(str(row["shard"]), str(row.get("phase") or "-"), _count(row.get("merges")), str(len(versions)),
                      span, _count(row.get("contributions_late")), str(row.get("last_checkpoint_seq") or "-"))
    return table


def render_status(st: dict, wide: bool = False) -> Group:
    """The run's figures, the learners (with the seconds since each was last heard from), the
    synchronizer shards when there are several, and the open rounds with the last merges, in 100
    columns; ``wide`` adds each learner's bytes per token, its link's figures and the learner ids
    of each round."""
    parts = [_run_figures(st, wide), "", _learners(st, wide)]
    if st.get("shards"):
        parts.append(_shards(st))
    return Group(*parts, _rounds(st, wide))


def main(url: str, watch: bool = False, interval_s: float = 2.0, wide: bool = False) -> int:
    """``diloco-async status``: print the synchronizer's view once, or with ``watch`` refresh it every
    ``interval_s`` until the run ends (in place on a terminal; one table per refresh when the output
    is a pipe or a file); ``wide``: see :func:`render_status`. Ctrl-C (exit status 130) or SIGTERM
    (143) stops watching with one line, also when the command was started with SIGINT ignored (a
    background job of a script inherits that), as ``train`` does. Must be called from the main
    thread (it sets both handlers)."""
    console = Console()
    try:
        st = fetch_run_status(url)
    except OSError as err:
        console.print(f"[red]error:[/red] no answer from {url}/status ({err})")
        return 2
    if not watch:
        console.print(render_status(st, wide))
        return 0
    signals: list[int] = []

    def _stop(signum: int, _frame) -> None:  # Ctrl-C or SIGTERM: stop watching
        signals.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(console, url, st, interval_s, wide)
    except KeyboardInterrupt:
        console.print("stopped watching (the run goes on)")
        return 143 if signals and signals[0] == signal.SIGTERM else 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(console: Console, url: str, st: dict, interval_s: float, wide: bool) -> int:
    live = Live(render_status(st, wide), console=console, refresh_per_second=4) if console.is_terminal else None
    if live is None:
        console.print(render_status(st, wide))
    else:
        live.start()
    try:
        while not st.get("finished"):
            time.sleep(interval_s)
            try:
                st = fetch_run_status(url)
            except OSError:
                console.print("synchronizer gone")
                return 0
            if live is None:
                console.print(render_status(st, wide))
            else:
                live.update(render_status(st, wide))
    finally:
        if live is not None:
            live.stop()
    return 0
