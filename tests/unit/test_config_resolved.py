"""One resolved config, passed as a value (issue 42, item 2): the recipe and its ``--set`` strings
are parsed once at an entry point, written as ``resolved-config.json``, and every process reads that
value; harnesses change a config by typed, validated fields, never by building override strings."""

from __future__ import annotations

import ast
import json
import re
import stat
from pathlib import Path

import pytest

from diloco_async.config.resolved import (
    RESOLVED_CONFIG_FILE,
    decoupled_diloco,
    read_resolved,
    synchronous_diloco,
    with_fields,
    write_resolved,
)
from diloco_async.config.schema import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.toml") if p.name != "calibration.toml")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_resolved_config_reads_back_as_exactly_the_value_written(tmp_path, recipe):
    cfg = load_config(recipe, ["synchronizer.outer_lr=0.25", 'run.storage_options={key="k"}'])
    path = write_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / RESOLVED_CONFIG_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the storage options: the owner's only
    back = read_resolved(path)
    assert back.model_dump() == cfg.model_dump() and back.run.storage_options == {"key": "k"}
    assert json.loads(path.read_text())["synchronizer"]["outer_lr"] == 0.25
    assert not list(path.parent.glob(".*.tmp"))  # written under a temporary name, renamed into place


def test_reading_a_bad_resolved_config_names_the_file_and_the_field(tmp_path):
    path = write_resolved(Config(), tmp_path)
    raw = json.loads(path.read_text())
    raw["learners"]["count"] = 0
    raw["synchronizer"]["bogus"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"(?s)invalid config .*resolved-config\.json.*learners\.count.*"
                                         r"synchronizer\.bogus: unknown field"):
        read_resolved(path)
    with pytest.raises(FileNotFoundError):
        read_resolved(tmp_path / "absent.json")


def test_with_fields_sets_typed_values_and_validates_the_whole_config():
    cfg = with_fields(Config(), {"learners.count": 3, "budget.wall_s": 60.0, "model.hf.cache_dir": "/tmp/hf",
                                 "faults.storage_faults": {"p_slow": 1.0, "ops": ["put"]}})
    assert (cfg.learners.count, cfg.budget.wall_s, cfg.model.hf.cache_dir) == (3, 60.0, "/tmp/hf")
    assert cfg.faults.storage_faults == {"p_slow": 1.0, "ops": ["put"]}
    assert cfg.budget.tokens == Config().budget.tokens  # fields not named keep their values
    with pytest.raises(ValueError, match="learners.bogus: unknown field"):
        with_fields(cfg, {"learners.bogus": 1})
    with pytest.raises(ValueError, match="learners.count"):
        with_fields(cfg, {"learners.count": 0})
    with pytest.raises(ValueError, match="min_quorum=4 exceeds learners.count=3"):  # cross-field checks too
        with_fields(cfg, {"synchronizer.min_quorum": 4})
    with pytest.raises(ValueError, match="must name a section and a field"):
        with_fields(cfg, {"learners": 1})
    with pytest.raises(ValueError, match="learners.count is a value, not a section"):
        with_fields(cfg, {"learners.count.x": 1})


def test_synchronous_diloco_is_one_named_value_and_decoupled_its_counterpart():
    cfg = load_config(None, ["learners.count=5"])
    sync = synchronous_diloco(cfg)
    assert (sync.synchronizer.min_quorum, sync.synchronizer.grace_enabled, sync.learners.barrier) == (5, False, True)
    back = decoupled_diloco(sync)
    assert (back.synchronizer.min_quorum, back.synchronizer.grace_enabled, back.learners.barrier) == (1, True, False)
    assert sync.model_dump()["model"] == cfg.model_dump()["model"]  # nothing else changes


def test_run_processes_hand_the_synchronizer_the_resolved_file_not_the_recipe(tmp_path):
    """The synchronizer's command line carries ``--resolved-config`` (the value written by the entry
    point), never ``--config`` or ``--set``."""
    from diloco_async.run import RunProcesses

    class Launcher:
        def start(self, name, argv, env):
            self.argv = argv
            ready = Path(argv[argv.index("--ready-file") + 1])
            ready.write_text(json.dumps({"url": "http://127.0.0.1:1", "epoch": "e1"}))
            return None

    cfg = load_config(None, [f"run.workdir={tmp_path}/runs", f"run.store=file://{tmp_path}/store",
                             "synchronizer.outer_lr=0.125", "learners.count=2"])
    launcher = Launcher()
    run = RunProcesses(cfg, run_id="r1", launcher=launcher, run_secret="0123456789abcdef" * 3)
    run.start_synchronizer()
    argv = launcher.argv
    assert "--config" not in argv and "--set" not in argv
    path = Path(argv[argv.index("--resolved-config") + 1])
    assert path == tmp_path / "runs" / "r1" / RESOLVED_CONFIG_FILE == run.config_file
    assert read_resolved(path).model_dump() == cfg.model_dump()


def test_the_process_command_lines_take_a_resolved_config_only():
    from diloco_async.baselines.ddp import _parser as ddp_parser
    from diloco_async.sync.process import build_parser

    for parser in (build_parser(), ddp_parser()):
        options = {o for a in parser._actions for o in a.option_strings}
        assert "--resolved-config" in options and not {"--config", "--set"} & options


def test_a_resume_resolves_its_config_once_from_the_recipe_or_the_stored_one():
    """``resume URL --set budget.tokens=N`` without a recipe: the run's stored config with the
    override; with a recipe: the recipe with it; neither: None (the stored config as it is)."""
    import time

    from diloco_async.flows.resolve import resume_config
    from diloco_async.storage import keys
    from diloco_async.storage.store import ObjectStore

    root = f"memory://resume-{time.time_ns()}"
    stored = load_config(None, ["learners.count=2", "synchronizer.outer_lr=0.5"])
    ObjectStore(root).put_json(keys.config_key("r1"), stored.public_dict())
    url = keys.checkpoint_url(root, "r1", 3)
    assert resume_config(url, None, [], {}) is None
    cfg = resume_config(url, None, ["budget.tokens=12345"], {})
    assert (cfg.learners.count, cfg.synchronizer.outer_lr, cfg.budget.tokens) == (2, 0.5, 12345)
    own = resume_config(url, str(ROOT / "configs/default.toml"), ["budget.tokens=12345"], {})
    assert own.model_dump() == load_config(ROOT / "configs/default.toml", ["budget.tokens=12345"]).model_dump()
    with pytest.raises(ValueError, match="no run 'r2'"):
        resume_config(keys.checkpoint_url(root, "r2", 1), None, ["budget.tokens=1"], {})


def test_validate_writes_the_resolved_config_a_run_by_hand_starts_from(tmp_path):
    from diloco_async.flows.resolve import write_recipe_resolved
    from diloco_async.validate import resolve_recipe

    path = write_recipe_resolved("default", ["learners.count=2"], str(tmp_path))
    assert read_resolved(path).model_dump() == load_config(resolve_recipe("default"), ["learners.count=2"]).model_dump()


# -- the source tree: one parser, no override strings built by harnesses -----------------------

#: the resolver (the config package) and the library's own CLI command ``diloco-async validate``
PARSING_ALLOWED = ("diloco_async/config/", "diloco_async/validate.py", "diloco_async/api.py",
                   "diloco_async/flows/")
#: ``benchmarks/ctrl_c.py`` types ``diloco-async train --set ...`` as a user would (the CLI's own strings);
#: ``diloco_async/flows/rehearsal.py`` fills the ``train``/``resume`` deployments' ``overrides`` parameter as an
#: operator does (``prefect deployment run --params``): those flows take strings
OVERRIDES_ALLOWED = ("benchmarks/ctrl_c.py", "diloco_async/flows/rehearsal.py")
#: strings shaped like an override that are not one: (file, text; ``\0`` a formatted value)
NOT_OVERRIDES = {("diloco_async/models/hf.py", "model.hf.pretrained=\0")}  # a label in an error message
SECTIONS = "|".join(Config.model_fields)
#: ``section.field=value``: a value without spaces, or a TOML table or array (spaces allowed); a
#: message that names a field with its value goes on with words after a space, and is not one
OVERRIDE = re.compile(rf"^({SECTIONS})\.[a-z_][a-z0-9_.]*=(\S*|[\[{{].*)$", re.DOTALL)


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def recipe_parsing(path: Path) -> list[str]:
    """``load_config``, ``read_toml`` and ``tomllib`` named in the code of ``path`` (imports and
    uses; docstrings and comments do not count)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names = [a.name.split(".")[0] for a in node.names] + module
        hits += [f"{_rel(path)}:{node.lineno}: {n}" for n in names if n in ("load_config", "read_toml", "tomllib")]
    return hits


def override_strings(path: Path) -> list[str]:
    """String literals and f-strings of ``path`` that are a whole ``section.field=value`` override."""
    hits = []
    tree = ast.parse(path.read_text(), str(path))
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts:  # a piece of an f-string: the f-string is judged whole
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if OVERRIDE.match(text) and (_rel(path), text) not in NOT_OVERRIDES:
            hits.append(f"{_rel(path)}:{node.lineno}: {text!r}")
    return hits


def test_the_checks_find_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import tomllib\nfrom diloco_async.config.schema import load_config\nx = load_config(None)\n'
                     'sets = [f"learners.count={4}", "budget.wall_s=60", "synchronizer.grace_enabled=false",\n'
                     '        f"learners.storage_faults={{p_slow={1.0!r}, ops=[\'put\']}}"]\n'
                     'msg = f"learners.device={3!r} is one device"\n')
    assert [h.split(": ", 1)[1] for h in recipe_parsing(probe)] == ["tomllib", "load_config", "load_config"]
    assert [h.split(": ", 1)[1] for h in override_strings(probe)] == [
        "'learners.count=\\x00'", "'budget.wall_s=60'", "'synchronizer.grace_enabled=false'",
        "\"learners.storage_faults={p_slow=\\x00, ops=['put']}\""]  # not the message


def test_no_recipe_parsing_in_the_library_outside_the_config_package():
    """Processes and harnesses get a :class:`Config`; only the resolver parses a recipe (diloco_async/flows/,
    benchmarks/, scripts/ and the Python API, diloco_async/api.py, are the entry points that call
    it, once)."""
    found = [hit for path in _sources("diloco_async") if not _rel(path).startswith(PARSING_ALLOWED)
             for hit in recipe_parsing(path)]
    assert found == []


def test_no_harness_builds_an_override_string():
    found = [hit for path in _sources("diloco_async", "benchmarks")
             if _rel(path) not in OVERRIDES_ALLOWED for hit in override_strings(path)]
    assert found == []
