"""Provenance (issue 45 item 3): the MLflow run's dataset inputs name every source shard of the corpus
with its digest (diloco_async/flows/provenance.py over the token store's corpus manifest), and the token stream."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from diloco_async.config.data import DataConfig
from diloco_async.config.schema import TrackingConfig
from diloco_async.data.tokens import open_corpus
from diloco_async.flows.provenance import DIGEST_CHARS, log_corpus
from diloco_async.flows.tracking import MlflowSink


def test_dataset_inputs_name_every_source_shard_with_its_digest(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        line = "the quick brown fox jumps over the lazy dog\n"
        (texts / f"part-{i}.txt").write_text(f"shard {i}: " + line * (40 + i))
    cfg = DataConfig(source="urls", urls=[f"file://{texts}/*.txt"], token_cache_dir=str(tmp_path / "cache"),
                     tokenize_workers=1)
    corpus = open_corpus(cfg, context=8)
    assert corpus.manifest_url.endswith(".json")
    with open(corpus.manifest_url.removeprefix("file://")) as fh:
        manifest = json.load(fh)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sink = MlflowSink(TrackingConfig(mlflow_uri=uri, artifact_location=str(tmp_path / "art")))
    sink.start("provenance", {}, {})
    assert log_corpus(sink, corpus.manifest_url) == 4 and sink.errors == 0
    inputs = MlflowClient(uri).get_run(sink.run_id).inputs.dataset_inputs
    by_name = {d.dataset.name: d.dataset for d in inputs}
    shards = {s["url"]: s for s in manifest["shards"]}
    assert sorted(shards) == sorted(f"file://{texts}/part-{i}.txt" for i in range(3))
    for url, shard in shards.items():
        ds = by_name[url]
        assert ds.digest == shard["digest"][:DIGEST_CHARS]
        profile = json.loads(ds.profile)
        assert profile["sha256"] == shard["digest"]
        assert profile["tokens"] == sum(p["tokens"] for p in shard["parts"]) > 0
    stream = next(d for n, d in by_name.items() if n.startswith("tokens:"))
    assert json.loads(stream.profile)["train_tokens"] == len(corpus.train)
    assert all(tag.key == "mlflow.data.context" and tag.value == "training" for d in inputs for tag in d.tags)
    assert log_corpus(sink, f"file://{tmp_path}/missing.json") == 0  # unreadable: logged, the run goes on
