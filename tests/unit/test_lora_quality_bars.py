"""The pure parts of ``make bench-lora`` (benchmarks/lora_quality.py): the statistics over seeds of
(base - fine-tuned) held-out loss and the bars table, on made-up per-seed results. The runs
themselves are the benchmark's; tests/system/test_models_system.py checks what holds on every run."""

from __future__ import annotations

import io

import pytest

from benchmarks.bars import print_bars
from benchmarks.lora_quality import FIGURE, LOWER_FIGURE, SeedResult, gap_stats, lora_bars, lora_model_toml, recipe_text


def _seeds(*gaps: float, base: float = 2.5) -> list[SeedResult]:
    return [SeedResult(seed=i, base_loss=base, final_loss=base - g, merges=20, tokens=240_000)
            for i, g in enumerate(gaps)]


def _table(results: list[SeedResult], on: str = "mean") -> tuple[int, dict[str, str]]:
    """(exit status, figure -> the rest of its line) of the printed bars table."""
    out = io.StringIO()
    status = print_bars(lora_bars(results, on), out)
    rows = {}
    for line in out.getvalue().splitlines():
        for figure in (FIGURE, LOWER_FIGURE):
            if line.startswith(figure + " "):
                rows[figure] = line[len(figure):]
    return status, rows


def test_the_gaps_their_mean_and_95_percent_interval_over_seeds():
    st = gap_stats(_seeds(0.01, 0.02, 0.03))
    assert st.gaps == pytest.approx([0.01, 0.02, 0.03])
    assert st.mean == pytest.approx(0.02)
    # t(0.975, 2) = 4.303, stdev 0.01, three seeds
    assert st.half == pytest.approx(4.303 * 0.01 / 3 ** 0.5, rel=1e-4)
    assert st.lower == pytest.approx(0.02 - st.half) and st.lower < 0
    one = gap_stats(_seeds(0.004))
    assert (one.mean, one.half, one.lower) == (pytest.approx(0.004), 0.0, pytest.approx(0.004))
    with pytest.raises(ValueError):
        gap_stats([])


def test_a_fine_tune_below_its_base_on_the_mean_passes_with_the_lower_end_shown():
    status, rows = _table(_seeds(0.021, 0.015, 0.018))
    assert status == 0
    assert rows[FIGURE].split()[:4] == ["0.018", ">=", "0", "ok"]
    assert "3 seeds, mean +0.0180 +- 0.0075 (95%): +0.0210, +0.0150, +0.0180" in rows[FIGURE]
    # lower end: 0.018 - 4.303 x 0.003 / sqrt(3) = 0.01055
    assert rows[LOWER_FIGURE].split()[0] == "0.01055" and rows[LOWER_FIGURE].split()[-1] == "shown"
    status, rows = _table(_seeds(0.021, 0.015, 0.018), on="lower")
    assert status == 0 and rows[LOWER_FIGURE].split()[:4] == ["0.01055", ">=", "0", "ok"]


def test_a_positive_mean_inside_the_seed_spread_passes_the_mean_bar_and_misses_the_lower_end_bar():
    results = _seeds(0.01, 0.02, 0.03)  # mean 0.02 +- 0.0248
    status, rows = _table(results)
    assert status == 0 and rows[FIGURE].split()[3] == "ok" and rows[LOWER_FIGURE].split()[-1] == "shown"
    status, rows = _table(results, on="lower")
    assert status == 1 and rows[LOWER_FIGURE].split()[3] == "MISS" and rows[FIGURE].split()[-1] == "shown"
    with pytest.raises(ValueError):
        lora_bars(results, on="median")


def test_a_fine_tune_no_better_than_its_base_is_a_miss_on_either_bar():
    # one good seed cannot carry two that made the model worse
    for on in ("lower", "mean"):
        status, rows = _table(_seeds(0.03, -0.02, -0.015), on)
        assert status == 1 and " MISS " in rows[FIGURE if on == "mean" else LOWER_FIGURE]
    # an adapter that never moved leaves the loss exactly at the base's: not strictly above 0
    status, rows = _table(_seeds(0.0, 0.0))
    assert status == 1 and rows[FIGURE].split()[0] == "0" and " MISS " in rows[FIGURE]


def test_a_seed_stopped_before_its_token_budget_leaves_the_figure_unmeasured():
    results = _seeds(0.02, 0.02)
    results[1] = SeedResult(1, 2.5, 2.48, stop_reason="wall time 1800 s")
    assert gap_stats(results).mean is None and gap_stats(results).unfinished == [1]
    status, rows = _table(results)
    assert status == 1 and rows[FIGURE].split()[0] == "n/a" and "seed(s) [1] did not stop" in rows[FIGURE]
    assert rows[LOWER_FIGURE].split()[0] == "n/a"


def test_the_recipe_is_the_system_tests_lora_recipe_with_the_budget(tmp_path):
    import tomllib

    doc = tomllib.loads(recipe_text(tmp_path, lora_model_toml(tmp_path / "base"), 123_000, 900.0))
    assert doc["model"]["hf"] == {"pretrained": str(tmp_path / "base")}
    assert doc["model"]["lora"] == {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    assert (doc["learners"]["count"], doc["learners"]["batch_size"], doc["model"]["context"]) == (2, 8, 32)
    assert (doc["synchronizer"]["sync_every"], doc["synchronizer"]["num_fragments"]) == (10, 2)
    assert doc["budget"] == {"tokens": 123_000, "wall_s": 900.0}
