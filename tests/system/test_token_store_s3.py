"""The token store across processes, on a real object store: the flow's prepare step tokenizes JSONL
and Parquet shards on moto's S3 server (loopback) with a pool of two worker processes into a store
on the same server; learner processes then map the prepared tokens without tokenizing anything. A
shard that does not parse, met by a worker, is named and nothing is built."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data import prose

from diloco_async.config.schema import load_config
from diloco_async.data.sources import corpus_bytes, resolve_sources
from diloco_async.data.tokens import split_point

from storage_servers import make_bucket

ROOT = Path(__file__).resolve().parents[2]

_LEARNER = textwrap.dedent("""
    import hashlib, json, logging, sys
    logging.basicConfig(level=logging.INFO)  # a learner that tokenized or trained would say so
    from diloco_async.config.schema import load_config
    from diloco_async.data.tokens import open_corpus
    cfg = load_config("configs/default.toml", json.loads(sys.argv[1]))
    corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
    shard = corpus.shard(int(sys.argv[2]), 2)
    print(json.dumps({"tokens": len(shard), "sha": hashlib.sha256(shard.tobytes()).hexdigest(),
                      "file": str(corpus.train.filename)}))
""")


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """A fresh bucket; URLs without options reach the server here and in every child process."""
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_endpoint.url})
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3_endpoint.url)
    return make_bucket("s3", s3_endpoint.storage_options)


def _upload_corpus(bucket: str, bad_line: int | None = None) -> None:
    fs = fsspec.filesystem("s3")
    for i in range(4):
        lines = [json.dumps({"text": prose(10 * i + j, 25)}) for j in range(30)]
        if bad_line is not None and i == 2:
            lines[bad_line - 1] = lines[bad_line - 1][:-3]
        fs.pipe(f"{bucket}/corpus/part-{i}.jsonl", ("\n".join(lines) + "\n").encode())
    for i in range(2):
        with fs.open(f"{bucket}/corpus/part-{4 + i}.parquet", "wb") as fh:
            pq.write_table(pa.table({"text": [prose(500 + 10 * i + j, 25) for j in range(30)]}), fh)


def _overrides(bucket: str, cache: Path) -> list[str]:
    return ['data.source="urls"', f'data.urls=["s3://{bucket}/corpus/part-*"]', f'data.token_store="s3://{bucket}/tokens"',
            f'data.token_cache_dir="{cache}"', "data.tokenize_workers=2", "data.tokenize_pool_min_bytes=0",
            'data.tokenizer="bpe:300"', "model.vocab_size=300", "model.context=32"]


def test_prepare_tokenizes_s3_shards_in_parallel_and_learners_map_the_result(tmp_path, s3):
    from diloco_async.flows.train import prepare_tokens

    _upload_corpus(s3)
    overrides = _overrides(s3, tmp_path / "cache")
    cfg = load_config("configs/default.toml", overrides)
    summary = prepare_tokens.fn(cfg)

    fs = fsspec.filesystem("s3")
    [manifest] = fs.glob(f"{s3}/tokens/corpora/*.json")
    doc = json.loads(fs.cat(manifest))
    assert doc["workers"] == 2 and len(doc["shards"]) == 6
    for shard in doc["shards"]:
        for part in shard["parts"]:  # every part's records in the store, as its manifest says
            assert fs.size(f"{s3}/tokens/shards/{part['key']}.bin") == part["tokens"] * 2
            assert json.loads(fs.cat(f"{s3}/tokens/shards/{part['key']}.json")) == part
    assert sum(len(s["parts"]) for s in doc["shards"]) == 7  # the shard holding the cut is two parts
    assert summary["train_tokens"] == doc["train_tokens"] and summary["vocab_size"] == 300

    raw = corpus_bytes(resolve_sources(cfg.data), "text")
    cut = split_point(raw, cfg.data.eval_fraction)
    procs = [subprocess.Popen([sys.executable, "-c", _LEARNER, json.dumps(overrides), str(i)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    learners = [json.loads(out) for out, _ in outs]
    assert not any("tokenized" in err or "trained" in err for _, err in outs), "a learner tokenized again"
    assert len({o["file"] for o in learners}) == 1 and sum(o["tokens"] for o in learners) == summary["train_tokens"]

    from diloco_async.data.tokens import open_corpus

    corpus = open_corpus(cfg.data, cfg.model.context)
    assert corpus.tokenizer.hf.decode(corpus.train.tolist()).encode() == raw[:cut]
    assert corpus.tokenizer.hf.decode(corpus.heldout.tolist()).encode() == raw[cut:]


def test_a_worker_that_meets_a_bad_line_names_it_and_nothing_is_built(tmp_path, s3):
    from diloco_async.flows.train import prepare_tokens

    _upload_corpus(s3, bad_line=17)
    cfg = load_config("configs/default.toml", _overrides(s3, tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"s3://{s3}/corpus/part-2.jsonl line 17: not JSON"):
        prepare_tokens.fn(cfg)
    assert not fsspec.filesystem("s3").glob(f"{s3}/tokens/**/*.bin")
    assert not list((tmp_path / "cache").glob("tokens/*/meta.json"))
