"""`diloco-async validate` / `recipes` and recipe resolution (issue 15, items 3 and 4)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import psutil
import pytest

from diloco_async.config.schema import STORE_SCHEMES
from diloco_async.flows.cli import main
from diloco_async.runtime.devices import cuda_device_count, mps_available
from diloco_async.storage.backends import PROTOCOLS
from diloco_async.validate import list_recipes, resolve_recipe

ROOT = Path(__file__).resolve().parents[2]


def _broken_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides of the default recipe, the field the failure must name)."""
    empty_dir, blanks, a_file = tmp_path / "empty", tmp_path / "blanks", tmp_path / "not-a-folder"
    urls = "data.source=urls"
    return {
        "bad store scheme": (["run.store=ftp://x"], "run.store"),
        "store not writable": ([f"run.store=file://{a_file}/runs"], "run.store"),
        "empty data glob": ([urls, f'data.urls=["{empty_dir}/*.txt"]'], "data.urls"),
        "only empty files": ([urls, f'data.urls=["{blanks}/*.txt"]'], "data.urls"),
        "unknown field": (["learners.colour=1"], "learners.colour"),
        "out-of-range value": (["learners.lr=-1"], "learners.lr"),
        "bad literal": (["learners.codec='fp8'"], "learners.codec"),
        "unknown tokenizer": (["data.tokenizer='wordpiece'"], "data.tokenizer"),
        "tokenizer larger than the model": (["data.tokenizer='bpe:512'"], "data.tokenizer"),
        "quorum above learners": (["synchronizer.min_quorum=9"], "synchronizer.min_quorum"),
        "more fragments than tensors": (["synchronizer.num_fragments=99"], "synchronizer.num_fragments"),
        "heads do not divide": (["model.n_head=5"], "model.d_model"),
        "slice larger than the corpus": (["data.slices=true", "learners.checkpoint_every_s=0",
                                          "data.slice_tokens=1000000000"], "data.slice_tokens"),
        "fewer slices than the learners hold": (["data.slices=true", "learners.checkpoint_every_s=0",
                                                 "data.slice_tokens=500000"], "data.slice_tokens"),
    }


@pytest.mark.parametrize("case", list(_broken_cases(Path("/nonexistent"))))
def test_broken_recipe_exits_2_naming_the_field(case, tmp_path, capsys):
    overrides, field = _broken_cases(tmp_path)[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "blanks").mkdir()
    (tmp_path / "blanks" / "a.txt").write_text("")
    (tmp_path / "blanks" / "b.txt").write_text("")
    (tmp_path / "not-a-folder").write_text("x")
    argv = ["validate", "default"]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "FAIL" in out.out and field in out.out, out.out
    assert field in out.err and "Traceback" not in out.out + out.err


def test_an_override_without_a_section_is_named_itself(capsys):
    """`--set budget=3` names `budget`, not the `learners.count` of the message's example."""
    assert main(["validate", "default", "--set", "budget=3"]) == 2
    out = capsys.readouterr()
    assert "[budget]" in out.out and "learners.count" not in out.err, (out.out, out.err)


def test_an_override_under_a_value_is_refused_naming_it(capsys):
    """`--set run.seed.x=1`: run.seed is a number, so nothing can be set under it (was a TypeError
    traceback, exit 1)."""
    assert main(["validate", "default", "--set", "run.seed.x=1"]) == 2
    out = capsys.readouterr()
    assert "run.seed is a value" in out.out + out.err and "Traceback" not in out.err, (out.out, out.err)


def test_a_malformed_recipe_names_its_file_and_line(tmp_path, capsys):
    bad = tmp_path / "broken.toml"
    bad.write_text("[learners]\ncount = 4\nlr = = 0.1\n")
    for argv in (["validate", str(bad)], ["validate", "--config", str(bad)], ["validate", "--recipe", str(bad)]):
        assert main(argv) == 2  # the recipe positionally, or as --config / --recipe like train takes it
        out = capsys.readouterr()
        assert str(bad) in out.out + out.err and "line 3" in out.out + out.err, (argv, out.out, out.err)


def test_write_resolved_writes_the_value_or_says_why_not(tmp_path, capsys):
    """``validate --write-resolved DIR`` writes DIR/resolved-config.json; a DIR that cannot be a
    folder (a file is there) is refused with exit 2 and a message, not a traceback."""
    from diloco_async.config.resolved import read_resolved

    assert main(["validate", "default", "--set", "learners.count=3", "--write-resolved", str(tmp_path / "ok")]) == 0
    assert read_resolved(tmp_path / "ok" / "resolved-config.json").learners.count == 3
    capsys.readouterr()
    (tmp_path / "a-file").write_text("x")
    assert main(["validate", "default", "--write-resolved", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert "--write-resolved" in err and "cannot write the resolved config there" in err and "Traceback" not in err


def test_validate_reads_the_caches_it_finds_and_fills_them_only_when_asked(tmp_path, capsys):
    """Without --fill-caches the token cache is left as it is: empty, it stays empty (the corpus is
    tokenized in a temporary folder); filled, it is read (a token count edited into its meta.json
    shows); the store's folder is not made. With --fill-caches the cache is filled as a run would."""
    import json

    tokens, store = tmp_path / "tokens", tmp_path / "store"
    tokens.mkdir()
    argv = ["validate", "default", "--set", f'data.token_cache_dir="{tokens}"', "--set", f'run.store="file://{store}"']
    assert main(argv) == 0
    assert list(tokens.iterdir()) == [] and not store.exists()
    assert main([*argv, "--fill-caches"]) == 0
    assert "caches filled" in capsys.readouterr().out
    (meta_file,) = tokens.glob("tokens/*/meta.json")
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "train_tokens": 1234567}))
    before = sorted(tokens.rglob("*"))
    assert main(argv) == 0
    assert "1,234,567 training" in capsys.readouterr().out
    assert sorted(tokens.rglob("*")) == before and not store.exists()


def test_unknown_recipe_name(capsys):
    assert main(["validate", "no-such-recipe"]) == 2
    out = capsys.readouterr()
    assert "no-such-recipe" in out.out and "default" in out.out


def _absent_devices() -> list[str]:
    """``learners.device`` values this machine lacks: one GPU past the visible ones always, plus
    ``cuda`` without a GPU and ``mps`` without MPS."""
    absent = [f"cuda:{cuda_device_count()}"]
    return absent + (["cuda"] if cuda_device_count() == 0 else []) + ([] if mps_available() else ["mps"])


@pytest.mark.parametrize("device", _absent_devices())
def test_validate_checks_devices_as_train_does(device, capsys):
    """`validate` fails a device this machine lacks with the message the local launcher raises
    before a run starts (issue 46: it said "valid" for learners.device=cuda on a CPU-only machine)."""
    from diloco_async.config.schema import load_config
    from diloco_async.run import RunProcesses

    setting = f'learners.device="{device}"'
    with pytest.raises(ValueError) as train_refused:  # raised first thing: nothing is created
        RunProcesses(load_config(resolve_recipe("default"), [setting]))
    assert main(["validate", "default", "--set", setting]) == 2
    out = capsys.readouterr()
    assert f"FAIL devices    [learners.device] ValueError: {train_refused.value}" in out.out, out.out
    assert repr(device) in out.out and "learners.device invalid" in out.err
    assert main(["validate", "default", "--set", 'learners.device="cpu"']) == 0
    assert "ok   devices    cpu x4" in capsys.readouterr().out


def test_train_refuses_an_unknown_store_scheme_before_starting(capsys):
    """Refused before anything starts: no process (this tier's guard fails the test on any process
    start, socket or sleep, however brief; the children check says it again), not a bound on seconds."""
    before = {c.pid for c in psutil.Process().children()}  # another test of this worker may have left some
    assert main(["train", "--set", "run.store=ftp://x"]) == 2
    err = capsys.readouterr().err
    assert "run.store" in err and "ftp" in err and "Traceback" not in err
    assert [c for c in psutil.Process().children() if c.pid not in before] == []


def test_store_schemes_cover_the_storage_protocols():
    assert set(PROTOCOLS) <= STORE_SCHEMES


def test_recipes_resolve_by_name_and_list_with_descriptions(capsys):
    assert resolve_recipe("default") == ROOT / "configs" / "default.toml"
    assert resolve_recipe("configs/default.toml") == Path("configs/default.toml")
    names = dict(list_recipes())
    assert names["default"][0].startswith("The default recipe")
    assert "calibration" not in names  # the simulator's calibration is not a training recipe
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    recipes_part, _, scenarios_part = out.partition("\nchaos scenario files")
    # one entry per recipe, each with its whole leading comment block, not only its first line
    assert [line.split()[0] for line in recipes_part.splitlines() if line and not line[0].isspace()] == sorted(names)
    flat = " ".join(recipes_part.split())
    assert 'docs/config.md "Config reference" explains each one.' in flat  # the 4th comment line of default.toml
    assert "the final artifact is the adapter plus LOADING.md" in flat  # lora-finetune, lines 3 and 4
    # a command example is kept on a line of its own, not reflowed into the prose
    assert any(line.strip() == "diloco-async train --recipe lora-finetune" for line in out.splitlines())
    # each recipe's prerequisites: the LoRA recipe's base is built when missing
    lora = flat[flat.index("lora-finetune LoRA"):]
    assert "needs model .local/pretrained/llama-cpu (" in lora and "built when missing (model.hf.pretrain)" in lora
    assert "needs corpus data/shakespeare (" in flat
    # then every scenario file of chaos, WAN and ablation runs, with the command that runs it
    for kind, command in (("chaos", "chaos --scenario"), ("wan", "wan --scenario"), ("ablations", "ablate --suite")):
        files = sorted(f"configs/{kind}/{p.name}" for p in (ROOT / "configs" / kind).glob("*.toml"))
        assert files and all(f"\n  {f}\n" in scenarios_part for f in files), kind
        assert f"(run one with `diloco-async {command} FILE`)" in out


def test_pyproject_lists_every_package_and_ships_configs():
    """`packages` is a list (configs/ is mapped in as diloco_recipes): a new package must be added."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".")
             for p in (ROOT / "diloco_async").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    recipe_dirs = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.toml")}
    mapped = {v for k, v in tool["package-dir"].items() if k.startswith("diloco_recipes")}
    assert recipe_dirs <= mapped, f"map into diloco_recipes: {sorted(recipe_dirs - mapped)}"


@pytest.mark.parametrize(("store", "meant"), [("s3:/bad", "s3://bad"), ("gs:bucket/runs", "gs://bucket/runs"),
                                              ("file:/tmp/runs", "file:///tmp/runs"), ("memory:", "memory://")])
def test_config_refuses_a_store_url_without_its_slashes(store, meant):
    """s3:/bucket was taken as a local folder named "s3:" and trained there (a fresh-clone check)."""
    from diloco_async.config.schema import load_config

    with pytest.raises(ValueError, match="run.store") as err:
        load_config("configs/default.toml", [f"run.store={store}"])
    assert "no '//'" in str(err.value) and f"did you mean {meant}?" in str(err.value)
    for fine in ("runs/store", "/tmp/runs", "./s3/runs", "file:///tmp/runs", "s3://bucket/runs"):
        assert load_config("configs/default.toml", [f"run.store={fine}"]).run.store == fine


@pytest.mark.parametrize("store", ["ftp://x", "http://bucket/runs", "sftp://host/runs"])
def test_config_refuses_an_unknown_store_scheme(store):
    from diloco_async.config.schema import load_config

    with pytest.raises(ValueError, match="run.store"):
        load_config("configs/default.toml", [f"run.store={store}"])
    load_config("configs/default.toml", ["run.store=memory://runs"])
