"""What a run trained on, recorded in MLflow (issue 45 item 3): the corpus's source shards and its
token stream as the run's dataset inputs (``mlflow.log_input``; in the UI, the run's "Datasets").

One input per source shard of the corpus manifest (the token store's ``corpora/{name}.json``,
:mod:`diloco_async.data.build`): named by its URL, its digest the first 32 hex digits of the
shard's sha256 (MLflow keeps at most 36 characters), the whole sha256, text bytes, documents and
token parts (key, tokens, sha256 of the records) in its profile. One more for the token stream
itself (``tokens:<manifest name>``: tokenizer, training and held-out tokens, corpus digest).
Context tag ``training``. Flows only: the library never imports MLflow.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import fsspec
from mlflow.entities import Dataset, DatasetInput, InputTag

__all__ = ["corpus_inputs", "log_corpus", "SLICE_FIGURES"]

log = logging.getLogger("diloco.flows")

#: the slice ledger's figures of summary.json logged as MLflow metrics ``data/<name>`` at the end of a run
SLICE_FIGURES = ("tokens_trained", "tokens_thrown_away", "tokens_requeued", "slices_trained", "slices_thrown_away",
                 "slices_requeued", "slices_never_reached", "slices_epoch")

#: MLflow's longest dataset digest is 36 characters; a sha256's first 32 hex digits (128 bits) name it
DIGEST_CHARS = 32


def corpus_inputs(manifest: dict, manifest_url: str) -> list[DatasetInput]:
    """The dataset inputs of a corpus manifest (the JSON ``corpora/{name}.json`` holds; see the module docstring)."""
    tag = [InputTag("mlflow.data.context", "training")]
    out = []
    for shard in manifest.get("shards", []):
        parts = shard.get("parts", [])
        profile = {"sha256": shard["digest"], "text_bytes": shard.get("text_bytes"), "documents": shard.get("docs"),
                   "tokens": sum(int(p.get("tokens", 0)) for p in parts),
                   "parts": [{"key": p.get("key"), "tokens": p.get("tokens"), "sha256": p.get("token_digest")}
                             for p in parts]}
        out.append(DatasetInput(Dataset(name=str(shard["url"])[:500], digest=str(shard["digest"])[:DIGEST_CHARS],
                                        source_type="url", source=json.dumps({"url": shard["url"]}),
                                        profile=json.dumps(profile)), tag))
    name = manifest_url.rsplit("/", 1)[-1].removesuffix(".json")
    stream = {k: manifest.get(k) for k in ("tokenizer", "tokenizer_digest", "vocab_size", "train_tokens",
                                           "heldout_tokens", "train_bytes", "heldout_bytes", "corpus_digest")}
    out.append(DatasetInput(Dataset(name=f"tokens:{name}"[:500], digest=str(manifest.get("corpus_digest", ""))[
        :DIGEST_CHARS] or "unknown", source_type="url", source=json.dumps({"url": manifest_url}),
        profile=json.dumps(stream)), tag))
    return out


def log_corpus(sink: Any, manifest_url: str, storage_options: dict | None = None) -> int:
    """Read the corpus manifest at ``manifest_url`` and log its inputs to ``sink`` (an
    :class:`~diloco_async.flows.tracking.MlflowSink`). Returns how many were logged; 0 (logged) when the manifest
    cannot be read, which never stops a run."""
    if not manifest_url:
        return 0
    try:
        with fsspec.open(manifest_url, "r", **(storage_options or {})) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as err:
        log.warning("dataset inputs not recorded: the corpus manifest could not be read (%s): %s", err,
                    manifest_url)
        return 0
    inputs = corpus_inputs(manifest, manifest_url)
    sink.log_inputs(inputs)
    return len(inputs)
