from pathlib import Path

import pytest

from diloco_async.config.schema import config_hash, load_config


def test_default_recipe_is_complete_and_valid():
    cfg = load_config("configs/default.toml")
    assert cfg.learners.count == 4 and cfg.synchronizer.min_quorum == 1
    assert cfg.data.source == "shakespeare"


def test_unknown_field_is_named(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[learners]\ncount = 2\ncuont = 3\n")
    with pytest.raises(ValueError, match=r"learners\.cuont: unknown field"):
        load_config(p)


def test_bad_literal_names_field_and_value():
    with pytest.raises(ValueError, match=r"learners\.adopt.*'replace'"):
        load_config(None, ["learners.adopt=replace"])


def test_overrides_and_cross_checks():
    cfg = load_config(None, ["learners.count=2", "synchronizer.merge=mean"])
    assert cfg.learners.count == 2 and cfg.synchronizer.merge == "mean"
    with pytest.raises(ValueError, match="min_quorum"):
        load_config(None, ["learners.count=2", "synchronizer.min_quorum=3"])
    with pytest.raises(ValueError, match="override"):
        load_config(None, ["nonsense"])


@pytest.mark.parametrize("item", ["budget.wall_s=inf", "synchronizer.outer_lr=nan", "learners.lr=-inf",
                                  "data.eval_fraction=nan"])
def test_inf_and_nan_are_refused_and_named(item):
    """A bound such as ``gt=0`` lets inf through (and NaN compares false to everything): a run
    with ``budget.wall_s=inf`` would never stop on time. Refused at load, naming the field."""
    field = item.split("=")[0].replace(".", r"\.")
    with pytest.raises(ValueError, match=field + ": Input should be a finite number"):
        load_config(None, [item])


def test_hash_ignores_secrets_and_local_paths():
    a = load_config(None, ["run.workdir=/tmp/a"])
    b = load_config(None, ["run.workdir=/tmp/b"])
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config(None, ["learners.lr=0.01"]))


def test_the_default_recipe_lists_every_field():
    """configs/default.toml says it lists every field (those without a value commented out)."""
    import re
    import tomllib

    from diloco_async.config.schema import Config

    text = Path("configs/default.toml").read_text()
    raw = tomllib.loads(text)
    sections = {m.start(): m.group(1) for m in re.finditer(r"^\[([a-z_]+)\]", text, re.M)}
    commented: dict[str, set[str]] = {}
    for m in re.finditer(r"^# ([a-z_]+) = ", text, re.M):
        section = sections[max(pos for pos in sections if pos < m.start())]
        commented.setdefault(section, set()).add(m.group(1))
    missing = [f"{name}.{key}" for name, field in Config.model_fields.items()
               for key in field.annotation.model_fields
               if key not in raw.get(name, {}) and key not in commented.get(name, set())]
    assert not missing, f"configs/default.toml does not list: {', '.join(missing)}"


def test_data_tokenizer_spec_is_checked_at_load():
    assert load_config(None, ['data.tokenizer="bpe:4096"']).data.tokenizer == "bpe:4096"
    assert load_config(None, ['data.tokenizer="s3://bucket/tok/tokenizer.json"']).data.tokenizer.endswith(".json")
    with pytest.raises(ValueError, match=r"data.tokenizer='wordpiece' is not a known tokenizer"):
        load_config(None, ['data.tokenizer="wordpiece"'])
    with pytest.raises(ValueError, match=r"data.format.*'csv'"):
        load_config(None, ['data.format="csv"'])
    # the tokenizer changes the training; where its cache lives does not
    assert config_hash(load_config(None, ['data.tokenizer="bpe:4096"'])) != config_hash(load_config(None))
    assert config_hash(load_config(None, ['data.token_cache_dir="/tmp/x"'])) == config_hash(load_config(None))


def test_register_model_takes_a_registry_name_only():
    assert load_config("configs/default.toml").tracking.register_model is None
    cfg = load_config("configs/default.toml", ["tracking.register_model=shakespeare-byte-gpt"])
    assert cfg.tracking.register_model == "shakespeare-byte-gpt"
    for bad in ("team/model", "models:m", "   "):
        with pytest.raises(ValueError, match="register_model"):
            load_config("configs/default.toml", [f"tracking.register_model={bad}"])
