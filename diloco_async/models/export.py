"""The final global model of an ``hf`` run as a folder that transformers (or peft) loads back.

* full training: ``save_pretrained`` of the transformers model (``config.json`` and
  ``model.safetensors``): ``AutoModelForCausalLM.from_pretrained(folder)`` gives it back;
* LoRA: the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and, unless the base
  is a Hub id or a remote URL another host reads too, the base itself under ``base/``;
  :func:`load_saved_model` (or the snippet in the folder's ``LOADING.md``) puts the adapter back
  onto its base with ``peft.PeftModel.from_pretrained``. The adapter's ``base_model_name_or_path``
  is a reference that works from another host (issue 46 item 5): the Hub id (with its
  ``revision``), the fsspec URL of the base, or the store URL of the folder's ``base/`` when the
  folder is uploaded to a store (``base_url``); ``base`` (the folder's own ``base/``) otherwise;
  never a path of the machine that trained it.

A tokenizer (anything with ``save_pretrained``) is saved beside the model when the data side has one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from diloco_async.config.model import ModelConfig, hub_repo_id
from diloco_async.models.hf import fetch_pretrained, unwrap_hf
from diloco_async.models.wrapper import CausalLM
from diloco_async.storage.store import ObjectStore

__all__ = ["save_final_model", "load_saved_model", "upload_folder", "LOADING_FILE"]

LOADING_FILE = "LOADING.md"

_LOADING_FULL = """# Loading this model

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("<this folder>")

Inputs are token ids (the run's tokenizer; bytes 0-255 when it trained on bytes).
"""

_LOADING_LORA = """# Loading this LoRA adapter

The folder holds a LoRA adapter (peft) trained on a frozen base: {base}.

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained("{base_path}"){base_note}
    model = PeftModel.from_pretrained(base, "<this folder>")
    model = model.merge_and_unload()  # optional: one plain transformers model

or ``diloco_async.models.load_saved_model("<this folder>")``.
"""


def save_final_model(model: nn.Module, cfg: ModelConfig, folder: str | Path, tokenizer: Any | None = None,
                     base_url: str | None = None) -> Path:
    """Write the ``hf`` model (a :class:`CausalLM` from ``build_model``) into ``folder``.

    Args:
        base_url: where ``folder`` will live (a store URL, no trailing slash needed): a LoRA
            adapter whose base is saved in ``base/`` names ``<base_url>/base`` as its base.

    Returns:
        ``folder``.

    Raises:
        TypeError: ``model`` is not an ``hf`` model.
    """
    if cfg.kind != "hf" or not isinstance(model, CausalLM):
        raise TypeError(f"save_final_model needs model.kind = 'hf' (got {cfg.kind!r})")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    net = unwrap_hf(model)
    net.save_pretrained(str(folder))
    text = _LOADING_FULL if cfg.lora is None else _save_lora_base(net, cfg, folder, base_url)
    (folder / LOADING_FILE).write_text(text)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def _remote(url: str | None) -> bool:
    return url is not None and "://" in url and not url.startswith("file://")


def _save_lora_base(net: nn.Module, cfg: ModelConfig, folder: Path, base_url: str | None) -> str:
    """Record the adapter's base as a portable reference (module docstring), saving the base in
    ``base/`` unless it is a Hub id or a remote URL; returns the ``LOADING.md`` text."""
    pretrained, revision = cfg.hf.pretrained, None
    hub = hub_repo_id(pretrained)
    if hub is not None:
        ref, revision, what = hub, cfg.hf.revision, f"the pretrained model {pretrained!r}"
    elif _remote(pretrained):
        ref, what = pretrained, f"the pretrained model at {pretrained}"
    else:
        if pretrained is not None:  # the loaded base, file for file (the peft model holds it with adapters)
            shutil.copytree(fetch_pretrained(pretrained, cfg.hf.cache_dir), folder / "base")
            what = "its pretrained base, copied into base/"
        else:
            net.get_base_model().save_pretrained(str(folder / "base"))
            what = "its randomly initialised base, saved in base/"
        ref = f"{base_url.rstrip('/')}/base" if base_url else "base"
    adapter_config = folder / "adapter_config.json"
    doc = json.loads(adapter_config.read_text())
    doc["base_model_name_or_path"] = ref
    if revision is not None:
        doc["revision"] = revision
    adapter_config.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if hub is not None:
        return _LOADING_LORA.format(base=what, base_path=hub, base_note="")
    if _remote(pretrained):  # transformers reads local folders and Hub ids, not fsspec URLs
        return _LOADING_LORA.format(base=what, base_path=f"<a local copy of {ref}>", base_note="")
    return _LOADING_LORA.format(base=what, base_path="<this folder>/base",
                                base_note=f"  # also at {ref}" if base_url else "")


def load_saved_model(folder: str | Path, base: str | Path | None = None, cache_dir: str = ".local/models") -> nn.Module:
    """A folder written by :func:`save_final_model`, loaded back as a float32 transformers model
    (an adapter is merged into its base: ``base``, else ``folder/base``, else the base the adapter
    names: a folder, a Hub id (the Hub or its local cache) or an fsspec URL (copied into
    ``cache_dir`` once, :func:`~diloco_async.models.hf.fetch_pretrained`)).

    Raises:
        ValueError: an adapter whose base cannot be found.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "adapter_config.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    from peft import PeftConfig, PeftModel

    net = None
    base_path = Path(base) if base is not None else folder / "base"
    if not base_path.is_dir():
        adapter = PeftConfig.from_pretrained(str(folder))
        ref = adapter.base_model_name_or_path or ""
        if hub_repo_id(ref) is not None:
            net = AutoModelForCausalLM.from_pretrained(hub_repo_id(ref), revision=adapter.revision, dtype=torch.float32)
        elif "://" in ref:
            base_path = fetch_pretrained(ref, cache_dir)
        else:
            base_path = Path(ref)
    if net is None:
        if not base_path.is_dir():
            raise ValueError(f"the base model of the adapter in {folder} is not at {str(base_path)!r}; pass base=")
        net = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32, local_files_only=True)
    return PeftModel.from_pretrained(net, str(folder)).merge_and_unload()


def upload_folder(store: ObjectStore, prefix: str, folder: str | Path) -> list[str]:
    """Put every file under ``folder`` into ``store`` at ``prefix`` + its relative path (exclusive
    create); returns the keys written, sorted."""
    folder = Path(folder)
    out = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = prefix + path.relative_to(folder).as_posix()
        store.put_from_file(key, path)
        out.append(key)
    return out
