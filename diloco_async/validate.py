"""Check a recipe without running it: ``diloco-async validate``.

:func:`validate_recipe` loads the config, checks the learners' devices on this machine as ``train``
does, probes the store, finds the data, builds the tokenizer,
the model and the fragment plan with the same builders a run uses (:func:`~diloco_async.data.tokens.open_corpus`,
:func:`~diloco_async.models.build_run_model`, :func:`~diloco_async.models.build.plan_of`),
and returns one :class:`Check` per step, each with its outcome and, when it fails, the recipe field
at fault. It starts no process, creates no run and leaves no file behind: the only object it writes
is a probe under the store's root, deleted again at once (with the folders it made for it, for a
local store that does not exist yet). The corpus download, the token cache and the pretrained-model
cache are read where the recipe puts them when they already hold what it needs, and otherwise
written to a temporary folder, removed at the end (:func:`scratch_caches`); ``fill_caches=True``
(``validate --fill-caches``) fills the recipe's own caches instead, as the first run would.

:func:`resolve_recipe` turns a recipe name (``default``) into its file: from ``configs/`` in a
source checkout, else from the installed package ``diloco_recipes`` (configs/ shipped as package
data). :func:`list_recipes` gives the names with their descriptions (each file's leading comments).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import re
import tempfile
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_async.config.schema import Config, load_config

__all__ = ["Check", "validate_recipe", "resolve_recipe", "recipe_field", "list_recipes", "recipe_description",
           "probe_store", "scratch_caches", "list_scenarios", "SCENARIO_COMMANDS", "recipe_prerequisites"]

#: the scenario folders of configs/ and the command that runs a file of each
SCENARIO_COMMANDS = {"chaos": "diloco-async chaos --scenario", "wan": "diloco-async wan --scenario",
                     "ablations": "diloco-async ablate --suite"}

_CHECKOUT_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True)
class Check:
    """One step of a validation.

    Attributes:
        name: the step (``config``, ``devices``, ``store``, ``prepare``, ``data``, ``tokenizer``, ``model``,
            ``fragments``).
        ok: whether it passed.
        detail: what was found (passed) or the error (failed).
        field: the recipe field at fault when it failed (e.g. ``run.store``), else None.
    """

    name: str
    ok: bool
    detail: str
    field: str | None = None


def _recipe_dirs() -> list[Path | Any]:
    """Where named recipes live: the checkout's configs/ first, then the installed package."""
    dirs: list[Path | Any] = []
    if _CHECKOUT_CONFIGS.is_dir():
        dirs.append(_CHECKOUT_CONFIGS)
    try:
        installed = importlib.resources.files("diloco_recipes")
        if installed.is_dir():
            dirs.append(installed)
    except (ModuleNotFoundError, NotADirectoryError):  # not installed, or an editable install's mapping
        pass
    return dirs


def resolve_recipe(name_or_path: str) -> Path:
    """The recipe file for a path (used as is when it exists) or a name (``default``,
    ``default.toml``, ``configs/default.toml``) looked up among the shipped recipes.

    Raises:
        FileNotFoundError: neither a file nor a known recipe name (the message lists the names).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    stem = path.name.removesuffix(".toml")
    for folder in _recipe_dirs():
        candidate = folder / f"{stem}.toml"
        if candidate.is_file():
            return Path(str(candidate))
    known = ", ".join(name for name, _ in list_recipes()) or "(none found)"
    raise FileNotFoundError(f"recipe {name_or_path!r} is neither a file nor a known recipe name; known: {known}")


def recipe_field(name_or_path: str) -> str:
    """:func:`resolve_recipe` as an absolute path, for the ``config`` field of a scenario or a
    suite file: ``configs/default.toml`` works from any folder (and in every process a run starts).

    Raises:
        ValueError: neither a file nor a known recipe name (the message lists the names).
    """
    try:
        return str(resolve_recipe(name_or_path).resolve())
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None


def recipe_description(text: str) -> list[str]:
    """The leading comment block of a recipe (the ``#`` lines before its first other line), as
    paragraphs: prose lines are joined into one paragraph until a blank ``#`` line; a line indented
    further after its ``#`` (a command example such as ``#   diloco-async train ...``) stays a
    paragraph of its own, with its indentation, so that it is not reflowed."""
    paragraphs: list[str] = []
    prose: list[str] = []

    def flush() -> None:
        if prose:
            paragraphs.append(" ".join(prose))
            prose.clear()

    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:]
        if not body.strip():
            flush()
        elif body.startswith("  "):  # "#   command": kept as it is
            flush()
            paragraphs.append(body.rstrip())
        else:
            prose.append(body.strip())
    flush()
    return paragraphs


def list_recipes() -> list[tuple[str, list[str]]]:
    """(name, description paragraphs, see :func:`recipe_description`) of every training recipe (a
    TOML file whose sections are all config sections), sorted by name; a name found in the checkout
    hides the installed one."""
    found: dict[str, list[str]] = {}
    for folder in _recipe_dirs():
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not entry.name.endswith(".toml") or entry.name.removesuffix(".toml") in found:
                continue
            text = entry.read_text()
            try:
                sections = set(tomllib.loads(text))
            except tomllib.TOMLDecodeError:
                continue
            if sections <= set(Config.model_fields):
                found[entry.name.removesuffix(".toml")] = recipe_description(text)
    return sorted(found.items())


def recipe_prerequisites(name_or_path: str) -> list[Any]:
    """What a recipe (a path or a shipped name) needs before it runs
    (:func:`~diloco_async.prerequisites.prerequisites`: reads only local folders).

    Raises:
        FileNotFoundError: no such recipe. ValueError: it does not validate.
    """
    from diloco_async.prerequisites import prerequisites

    return prerequisites(load_config(resolve_recipe(name_or_path)))


def list_scenarios() -> list[tuple[str, str, list[str]]]:
    """(folder, file, description paragraphs) of every chaos, WAN and ablation scenario file
    (:data:`SCENARIO_COMMANDS`), sorted; the file's path relative to the current folder where it
    is under it (``configs/<folder>/<name>.toml`` from a checkout's root), else absolute (a path
    that works wherever the command was run); a name found in the checkout hides the installed one."""
    found: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for root in _recipe_dirs():
        for kind in SCENARIO_COMMANDS:
            folder = root / kind
            if not folder.is_dir():
                continue
            for entry in sorted(folder.iterdir(), key=lambda e: e.name):
                if entry.name.endswith(".toml") and (kind, entry.name) not in found:
                    found[(kind, entry.name)] = (_shown(entry), recipe_description(entry.read_text()))
    return [(kind, *found[(kind, name)]) for kind, name in sorted(found)]


def _shown(path: Path) -> str:
    """``path`` relative to the current folder where it is under it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def probe_store(url: str, storage_options: dict[str, Any], timeout_s: float = 10.0) -> str:
    """Write a small probe object under the store root, read it back and delete it; for a local
    store, the folders made for it are removed again (the run makes them).

    Returns:
        What was found: ``{store URL} is writable``, and for a local store whose folder does
        not exist yet, that the run makes it.

    Raises:
        ValueError: unknown scheme. OSError (or a backend error): unreachable or not writable.
    """
    from diloco_async.storage.retry import RetryPolicy
    from diloco_async.storage.store import ObjectStore

    policy = RetryPolicy(timeout_s=timeout_s, retries=1, deadline_s=2 * timeout_s)
    store = ObjectStore(url, storage_options, policy=policy)
    made = _missing_folders(Path(store.root)) if store.protocol in ("file", "local") else []
    key = f"validate-probe-{uuid.uuid4().hex}"
    try:
        store.put(key, b"diloco-async validate probe")
        if not store.exists(key):
            raise OSError(f"probe {key} written but not listed")
        store.delete(key)
    finally:
        for folder in made:
            with contextlib.suppress(OSError):  # not empty: something else was written there meanwhile
                folder.rmdir()
    return f"{store.url} is writable" + (" (the folder does not exist yet: a run makes it)" if made else "")


def _linked(cache: Path, scratch: Path, complete: Callable[[Path], bool]) -> str:
    """``scratch``, made, holding a link to each entry of the folder ``cache`` that is complete."""
    scratch.mkdir(parents=True)
    if cache.is_dir():
        for entry in cache.iterdir():
            if complete(entry):
                (scratch / entry.name).symlink_to(entry.resolve())
    return str(scratch)


def scratch_caches(cfg: Config, scratch: Path) -> Config:
    """``cfg`` with its local caches moved under ``scratch``, so that building the corpus, the
    tokenizer and the model writes nothing where the recipe's caches are; what they already hold
    complete stays readable through links: the Shakespeare download (its ``.complete`` marker),
    trained tokenizers (``*.json``, written by rename), token folders (with their ``meta.json``,
    written last) and pretrained-model copies (renamed into place when complete)."""
    data, tokens = cfg.data, Path(cfg.data.token_cache_dir)
    _linked(tokens / "tokenizers", scratch / "tokens" / "tokenizers", lambda e: e.name.endswith(".json"))
    _linked(tokens / "tokens", scratch / "tokens" / "tokens", lambda e: (e / "meta.json").is_file())
    cache_dir = _linked(Path(data.cache_dir), scratch / "data", lambda e: (e / ".complete").is_file())
    models = _linked(Path(cfg.model.hf.cache_dir), scratch / "models", lambda e: ".tmp-" not in e.name)
    return cfg.model_copy(update={
        "data": data.model_copy(update={"cache_dir": cache_dir, "token_cache_dir": str(scratch / "tokens")}),
        "model": cfg.model.model_copy(update={"hf": cfg.model.hf.model_copy(update={"cache_dir": models})})})


_FIELD = re.compile(r"^\s+([A-Za-z_][\w.]*):", re.M)


def _config_field(message: str) -> str | None:
    """The first field a config error names (``run.store``, ``model.n_head``, ...), after its
    first line (which echoes the recipe and the overrides)."""
    message = message.split("\n", 1)[1] if "\n" in message else message
    bad_override = re.search(r"override '([^'=]*)=", message)  # names no section.field (the example would)
    if bad_override:
        return bad_override.group(1) or None
    named = re.search(r"\b((?:run|data|model|learners|synchronizer|budget|tracking|network)\.\w+)", message)
    if named:
        return named.group(1)
    m = _FIELD.search(message)
    return m.group(1) if m else None


def _step(checks: list[Check], name: str, field: str | None, fn, *args) -> Any:
    """Run one step; record its outcome; return its value (None when it failed)."""
    try:
        value, detail = fn(*args)
    except Exception as err:  # every failure is reported as a check naming the field, never raised
        checks.append(Check(name, False, f"{type(err).__name__}: {err}", field))
        return None
    checks.append(Check(name, True, detail))
    return value


def _devices(cfg: Config) -> tuple[Any, str]:
    """The learners' devices, checked as ``train`` checks them with the local launcher
    (:func:`~diloco_async.runtime.devices.check_devices`, same message); with the deployments
    launcher each region's worker resolves its learner's device when the learner starts."""
    if cfg.run.launcher != "local":
        return None, f"{cfg.learners.device!r}: resolved by each region's worker when its learner starts"
    from diloco_async.runtime.devices import check_devices

    found = [str(d) for d in check_devices(cfg.learners)]
    return found, ", ".join(f"{d} x{found.count(d)}" for d in dict.fromkeys(found)) + " (rank 0 of each learner)"


def _network(cfg: Config) -> tuple[Any, str]:
    """The TLS files of a ``tls`` run, checked as ``train`` checks them before it starts anything
    (:func:`~diloco_async.sync.check_network`; docs/network-modes.md)."""
    from diloco_async.sync import check_network

    check_network(cfg)
    modes = cfg.network.modes(cfg.learners.count)
    if "tls" not in modes:
        return None, "direct: plain HTTP and WebSocket"
    mutual = cfg.network.client_ca is not None
    return None, (f"tls{' with mutual TLS' if mutual else ''}: the synchronizer's certificate, its key and "
                  f"the CA bundle checked{', and every client certificate' if mutual else ''}")


def _data(cfg: Config) -> tuple[Any, str]:
    from diloco_async.data.sources import resolve_sources

    files = resolve_sources(cfg.data)
    return files, f"{len(files)} file(s), {sum(f.size_bytes for f in files):,} bytes"


def _tokens(cfg: Config) -> tuple[Any, str]:
    from diloco_async.data.tokens import open_corpus

    corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
    corpus.shard(cfg.learners.count - 1, cfg.learners.count)  # every learner gets a usable shard
    return corpus, (f"{cfg.data.tokenizer} (vocab {corpus.vocab_size}): {len(corpus.train):,} training and "
                    f"{len(corpus.heldout):,} held-out tokens")


def _slices(cfg: Config, corpus: Any) -> tuple[Any, str]:
    """The leased slices of ``corpus`` (``data.slices``), checked as ``train`` checks them
    (:func:`~diloco_async.policy.slices.check_corpus_slices`, same message)."""
    from diloco_async.policy.slices import check_corpus_slices, slices_needed

    n = check_corpus_slices(cfg, len(corpus.train))
    need = slices_needed(cfg)
    return n, f"{n} slices of {cfg.data.slice_tokens} tokens (at least {need} for {cfg.learners.count} learners)"


def _model(cfg: Config) -> tuple[Any, str]:
    import torch

    from diloco_async.models import build_run_model, trainable_parameters

    torch.manual_seed(cfg.run.seed)
    model = build_run_model(cfg)  # as the synchronizer builds Θ^0
    params = trainable_parameters(model)
    return (model,), f"{len(params)} trainable tensors, {sum(p.numel() for p in params.values()):,} parameters"


def _prerequisites(cfg: Config, scratch: Path | None) -> tuple[Config, str]:
    """Make what the flow makes before a run starts (:func:`~diloco_async.prerequisites.prepare`:
    Hub downloads, a missing base model); with a ``scratch`` folder (no ``--fill-caches``) a missing
    base is built there untrained (0 steps: the same shapes and tokenizer) and read from there."""
    from diloco_async.prerequisites import prepare

    hf = cfg.model.hf
    if scratch is not None and hf.pretrain is not None and not Path(str(hf.pretrained)).expanduser().is_dir():
        base, tok = scratch / "base", cfg.data.tokenizer
        if Path(tok).parent == Path(str(hf.pretrained)):  # the tokenizer saved with the base
            tok = str(base / Path(tok).name)
        hf = hf.model_copy(update={"pretrained": str(base), "pretrain": hf.pretrain.model_copy(update={"steps": 0})})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf": hf}),
                                     "data": cfg.data.model_copy(update={"tokenizer": tok})})
    done = prepare(cfg)
    return cfg, "; ".join(done) if done else "nothing to download or build"


def _plan(cfg: Config, model: Any) -> tuple[Any, str]:
    from diloco_async.models.build import plan_of

    sc = cfg.synchronizer
    plan = plan_of(model, sc.num_fragments, sc.fragmentation)  # the plan learners are checked against at join
    rows = [f"fragment {p}: {len(frag)} tensors, {sum(s.numel * _itemsize(s.dtype) for s in frag):,} bytes"
            for p, frag in enumerate(plan.fragments)]
    return plan, f"{plan.num_fragments} fragments\n" + "\n".join(rows)


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def validate_recipe(recipe: str | None, overrides: list[str] | None = None,
                    storage_options: dict[str, Any] | None = None, fill_caches: bool = False) -> list[Check]:
    """Check a recipe (a path or a shipped recipe name) with ``--set`` overrides, without running it.

    Args:
        recipe: path or name (see :func:`resolve_recipe`); None: the built-in defaults.
        overrides: ``section.field=value`` strings.
        storage_options: extra fsspec options for the store (e.g. from the environment), over
            ``run.storage_options``.
        fill_caches: download and build into the recipe's own caches (``data.cache_dir``,
            ``data.token_cache_dir``, ``model.hf.cache_dir``), as the first run would; by default
            what they lack is built in a temporary folder (:func:`scratch_caches`).

    Returns:
        The checks in order; a failed ``config`` check is the only one (nothing else can be built).
    """
    checks: list[Check] = []

    def config() -> tuple[Config, str]:
        path = None if recipe is None else resolve_recipe(recipe)
        return load_config(path, overrides or []), str(path or "(defaults)")

    try:
        cfg, where = config()
    except (ValueError, FileNotFoundError, tomllib.TOMLDecodeError) as err:
        return [Check("config", False, str(err), _config_field(str(err)) or "recipe")]
    checks.append(Check("config", True, where))
    _step(checks, "devices", "learners.device", _devices, cfg)
    _step(checks, "network", "network", _network, cfg)
    options = {**cfg.run.storage_options, **(storage_options or {})}
    _step(checks, "store", "run.store", lambda: (None, probe_store(cfg.run.store, options)))
    with tempfile.TemporaryDirectory(prefix="diloco-validate-") as scratch:
        built_cfg = cfg if fill_caches else scratch_caches(cfg, Path(scratch))
        built_cfg = _step(checks, "prepare", "model.hf.pretrained", _prerequisites, built_cfg,
                          None if fill_caches else Path(scratch))
        if built_cfg is None:
            return checks
        files = _step(checks, "data", "data.urls" if cfg.data.source == "urls" else "data.source", _data, built_cfg)
        corpus = None if files is None else _step(checks, "tokenizer", "data.tokenizer", _tokens, built_cfg)
        if corpus is not None and cfg.data.slices:
            _step(checks, "slices", "data.slice_tokens", _slices, built_cfg, corpus)
        built = _step(checks, "model", "model", _model, built_cfg)
        if built is not None:
            _step(checks, "fragments", "synchronizer.num_fragments", _plan, cfg, *built)
    return checks
