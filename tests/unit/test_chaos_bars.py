"""The chaos harness's pure parts: the bars of ``make bench-chaos`` (benchmarks/chaos_bars.py) from
the files ``diloco-async chaos --out`` writes, the eval loss at equal tokens, and the user's
overrides and methods on a scenario. The harness itself runs in tests/system/test_chaos.py."""

from __future__ import annotations

import json
import math

import pytest

from diloco_async.chaos import load_scenario
from diloco_async.chaos.measure import eval_at


def test_eval_at_equal_tokens_interpolates_between_snapshots():
    curve = [(0.0, 0.0, 5.0), (10.0, 100.0, 3.0), (20.0, 200.0, 2.0)]  # (seconds, tokens, loss)
    assert eval_at(curve, 150) == (2.0, pytest.approx(2.5))
    assert eval_at(curve, 100) == (2.0, 3.0)
    assert eval_at(curve, 201) == (2.0, None)  # never reached


def _row(method, cg, eq_tokens, curve=(), eq_time=2.0, wall_s=None):
    return {"method": method, "compute_goodput": cg, "eval_loss_equal_tokens": eq_tokens, "eval_curve": list(curve),
            "eval_loss_equal_time": eq_time, "wall_s": wall_s}


def _docs():
    """The three files of a ``make bench-chaos`` run (each method's window: its scenario's wall time
    unless given: configs/chaos/storm.toml and failure-free.toml 300 s, straggler.toml 90 s)."""
    storm = {"scenario": "storm", "availability": 0.8, "eval_tokens": 150, "rows": [
        _row("ddp", 0.1, None), _row("sync-diloco", 0.3, None, wall_s=300.4),
        _row("decoupled", 0.76, 2.1, eq_time=1.9)]}
    ff = {"scenario": "failure-free", "availability": 1.0, "eval_tokens": 150, "rows": [
        _row("ddp", 0.6, 2.0, [(0, 0, 5.0), (10, 100, 2.2), (20, 200, 1.8)]), _row("decoupled", 0.95, 2.05)]}
    straggler = {"scenario": "straggler", "availability": 1.0, "rows": [
        _row("sync-diloco", 0.7, 2.5), _row("decoupled", 0.99, 2.4, wall_s=89.5)]}
    for doc, wall in ((storm, 300.0), (ff, 300.0), (straggler, 90.0)):
        for r in doc["rows"]:
            r["wall_s"] = wall if r["wall_s"] is None else r["wall_s"]
    return {"storm": storm, "ff": ff, "straggler": straggler}


def _write(tmp_path, docs) -> list[str]:
    paths = []
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"{name}.json"))
    return paths


def _printed(out: str) -> dict[str, tuple[str, str]]:
    """figure -> (value, result) of each line of the bars table."""
    rows = {}
    for line in out.splitlines():
        parts = line.rsplit(None, 4)
        if len(parts) == 5 and parts[-1] in ("ok", "MISSED"):
            rows[parts[0].strip()] = (parts[1], parts[-1])
    return rows


def test_chaos_bars_ratios_and_exit_status(tmp_path, capsys):
    from benchmarks.chaos_bars import main

    docs = _docs()
    paths = _write(tmp_path, docs)
    assert main(paths) == 0
    rows = _printed(capsys.readouterr().out)
    # 0.76/0.8 = 0.95; 0.76/0.1 = 7.6; 0.76 - 0.3 = 0.46; 2.05/2.0 = 1.025; storm 2.1 against DDP's 2.0 at
    # 150 tokens = 1.05; the storm's final decoupled loss 1.9; straggler 0.99, 0.99 - 0.7 = 0.29, K = M's 0.7;
    # the longest window 300.4 s of a 300 s wall: 0.4 s over
    assert rows == {
        "storm: decoupled compute goodput / mean availability": ("0.950", "ok"),
        "storm: decoupled compute goodput / DDP's": ("7.600", "ok"),
        "storm: decoupled compute goodput - sync-diloco's": ("0.460", "ok"),
        "storm: decoupled eval loss at equal time (nats/byte)": ("1.900", "ok"),
        "failure-free: decoupled eval loss / DDP's, equal tokens": ("1.025", "ok"),
        "storm decoupled / failure-free DDP eval loss, equal tokens": ("1.050", "ok"),
        "straggler: K=1 with grace, compute goodput": ("0.990", "ok"),
        "straggler: K=1 compute goodput - K=M's": ("0.290", "ok"),
        "straggler: K=M (shown, no bar), compute goodput": ("0.700", "ok"),
        "every method's window past the scenario's wall time (s)": ("0.400", "ok"),
    }
    # each bar missed on its own
    misses = [
        ("ff", lambda d: d["rows"][1].update(eval_loss_equal_tokens=2.1),  # 5% above DDP: the 3% bar
         "failure-free: decoupled eval loss / DDP's, equal tokens"),
        ("storm", lambda d: d["rows"][1].update(compute_goodput=0.6),  # 0.16 apart: the 0.2 bar
         "storm: decoupled compute goodput - sync-diloco's"),
        ("storm", lambda d: d["rows"][2].update(eval_loss_equal_time=math.log(256) - 0.5),  # learned too little
         "storm: decoupled eval loss at equal time (nats/byte)"),
        ("straggler", lambda d: d["rows"][0].update(compute_goodput=0.9),  # 0.09 apart: the 0.15 bar
         "straggler: K=1 compute goodput - K=M's"),
        ("straggler", lambda d: d["rows"][1].update(wall_s=91.5),  # ran 1.5 s past its wall time
         "every method's window past the scenario's wall time (s)"),
    ]
    for name, change, figure in misses:
        docs = _docs()
        change(docs[name])
        assert main(_write(tmp_path, docs)) == 1, figure
        rows = _printed(capsys.readouterr().out)
        assert [f for f, (_, result) in rows.items() if result == "MISSED"] == [figure]
    # without the straggler file: its bars are not printed, the others are
    docs = _docs()
    assert main(_write(tmp_path, {"storm": docs["storm"], "ff": docs["ff"]})) == 0
    assert not any(f.startswith("straggler") for f in _printed(capsys.readouterr().out))


def test_chaos_bars_wall_time_from_the_file_or_the_shipped_scenario(tmp_path, capsys):
    """A file's own ``wall_s`` wins over the shipped scenario of its name; a scenario that is neither
    leaves the figure unmeasured, which misses the bar."""
    from benchmarks.chaos_bars import main

    figure = "every method's window past the scenario's wall time (s)"
    docs = _docs()
    docs["storm"]["wall_s"] = 300.2  # a run of its own wall time: sync-diloco's 300.4 s is 0.2 s past it
    assert main(_write(tmp_path, docs)) == 0
    assert _printed(capsys.readouterr().out)[figure] == ("0.200", "ok")
    docs = _docs()
    docs["straggler"]["scenario"] = "my-straggler"  # not shipped, no wall_s in the file
    assert main(_write(tmp_path, docs)) == 1
    out = capsys.readouterr().out
    assert f"{figure:62s}      n/a   (not reached)  MISSED" in out


def test_user_overrides_and_methods_for_chaos_and_wan_scenarios():
    """One rule for both harnesses: the user's overrides go after the scenario's, methods keep the
    order given, an unknown method or a field the harness sets is refused."""
    from diloco_async.chaos.scenario import with_user_overrides
    from diloco_async.wan.scenario import load_wan_scenario

    for sc in (load_scenario("configs/chaos/straggler-ci.toml"), load_wan_scenario("configs/wan/wan-ci.toml")):
        out, chosen = with_user_overrides(sc, ["synchronizer.outer_lr=0.5"], ["decoupled", "ddp"])
        assert out.scenario.overrides == [*sc.scenario.overrides, "synchronizer.outer_lr=0.5"]
        assert chosen == ["decoupled", "ddp"] and type(out) is type(sc)
        assert with_user_overrides(sc, None, None) == (sc, list(sc.scenario.methods))
        with pytest.raises(ValueError, match="unknown method 'dp'"):
            with_user_overrides(sc, None, ["dp"])
        with pytest.raises(ValueError, match="learners.count"):
            with_user_overrides(sc, ["learners.count=7"], None)
