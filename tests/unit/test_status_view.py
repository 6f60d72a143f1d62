"""``diloco-async status``'s tables (diloco_async/flows/status_view.py) on a /status document as the synchronizer
writes it: they fit 100 columns even with large figures, many learners, a long stop reason and a
link-bound learner (issue 46: they needed about 150), ``--wide`` shows what the default leaves out,
and the rounds table lists the last merges (a round is open for a fraction of a second, so the
open rounds alone were empty at almost every refresh). A live synchronizer's document is
tests/contract/test_synchronizer.py's."""

from __future__ import annotations

from rich.console import Console

from diloco_async.flows.status_view import render_status

IDS = [f"learner-{i}" for i in range(240, 256)]


def _learner(i: int) -> dict:
    return {"live": i % 3 != 0, "step": 1_234_567, "incarnation": 12, "tokens_processed": 123_456_789_012,
            "contributions": {"merged": 123_456, "late": 12_345, "rejected": 1_234}, "compute_goodput": 0.987654,
            "heartbeat_age_s": 1234.5, "bytes_up_per_token": 1234.56, "bytes_down_per_token": 2345.67,
            "link_s_per_fragment": 12.345, "link_budget_s": 1.234, "link_bound": i % 2 == 0, "network_mode": "tls"}


def large_status() -> dict:
    """Every figure near the largest a run shows: 16 learners each in a round, 64 fragments."""
    return {
        "run_id": "20261206-134600-3a33da", "stopping": "token budget reached (123456789012 >= 123456789000)",
        "wall_s": 123456.7, "global_step": 1_234_567, "merges": 1_234_567, "contributions_merged": 12_345_678,
        "contributions_late": 123_456, "contributions_rejected": 12_345, "compute_goodput": 0.9, "token_goodput": 0.8,
        "bytes_in": 2**50, "bytes_out": 2**50, "bytes_up_per_token": 1234.5, "bytes_down_per_token": 2345.6,
        "budget": {"tokens": 10**12, "max_steps": 10**7, "wall_s": 10**6}, "tokens_processed": 10**11,
        "versions": {str(p): 123_456 for p in range(64)},
        "rejected_by_reason": {r: 123 for r in ("bad_digest", "bad_shape", "non_finite", "norm_bound", "stale")},
        "learners": {lid: _learner(i) for i, lid in enumerate(IDS)},
        "refused_by_mode": {"tls": 123_456},
        "rounds": [{"fragment": 63, "round": 123_456, "stage": "merging", "open_s": 123.4, "announced": IDS,
                    "verified": IDS[:15]}],
        "recent_merges": [{"fragment": 62, "round": 123_455, "version": 1_234_567, "learners": IDS, "age_s": 1234.5}],
    }


def _text(st: dict, wide: bool = False) -> str:
    console = Console(record=True, width=400)  # wide enough that nothing is wrapped to fit it
    console.print(render_status(st, wide))
    return console.export_text()


def test_the_tables_fit_100_columns():
    text = _text(large_status())
    over = [line for line in text.splitlines() if len(line.rstrip()) > 100]
    assert not over, "\n".join(over)
    for needle in ("learner-255", "bound", "123.5G", "1,024.0 TiB in", "tokens 10% · steps 12% · wall 12%",
                   "stale 123", "p63: v123456", "merged: v1234567", "1234.5 s ago", "open 123.4 s",
                   "tls 16 · refused tls 123456"):
        assert needle in text, needle


def test_wide_shows_what_the_default_leaves_out():
    st = large_status()
    default, wide = _text(st), _text(st, wide=True)
    assert "B/token up / down" in wide.split("learners", 1)[1] and "1234.56 / 2345.67" in wide
    assert "1234.56 / 2345.67" not in default  # per learner: --wide only (the run's figure is in both)
    assert "link-bound: needs 12.345 s per fragment, has 1.234 s" in wide and "needs" not in default
    assert "ok 12.345 / 1.234 s" in wide
    assert "lost tls" in wide and "lost tls" not in default  # each learner's network mode
    assert "learner-254, learner-255" in " ".join(wide.split()) and "learner-254," not in default
    assert " 16 " in default.split("open rounds", 1)[1] and " 15 " in default.split("open rounds", 1)[1]


def test_the_rounds_table_lists_the_last_merges_when_no_round_is_open():
    st = {**large_status(), "rounds": [], "recent_merges": [
        {"fragment": 1, "round": 7, "version": 7, "learners": ["learner-0", "learner-3"], "age_s": 0.4},
        {"fragment": 0, "round": 7, "version": 6, "learners": ["learner-1"], "age_s": 1.9}]}
    rows = [line.split() for line in _text(st).split("open rounds and recent merges", 1)[1].splitlines()]
    assert ["1", "7", "merged:", "v7", "2", "0.4", "s", "ago"] in rows
    assert ["0", "7", "merged:", "v6", "1", "1.9", "s", "ago"] in rows


def test_a_sharded_run_shows_a_row_per_shard_within_100_columns():
    """Two shards' documents aggregated (diloco_async.metrics.shards): the run's figures once, a
    table of the shards, one not answering; still 100 columns."""
    from diloco_async.metrics.shards import aggregate_status

    zero, one = large_status(), large_status()
    zero["versions"] = {str(p): 123_456 for p in range(0, 64, 2)}
    one["versions"] = {str(p): 654_321 for p in range(1, 64, 2)}
    st = aggregate_status([zero, one, None], urls=["http://10.0.0.1:8470", "http://10.0.0.2:8471",
                                                   "http://10.0.0.3:8472"])
    text = _text(st)
    assert "synchronizer shards" in text and "not answering" in text and "v654321" in text
    assert "p0: v123456" in text and "p1: v654321" in text  # the run's versions: every fragment's
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "synchronizer shards" not in _text(large_status())  # one synchronizer: as before
