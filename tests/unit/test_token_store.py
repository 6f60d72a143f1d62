"""The token store (diloco_async/data/store.py, build.py): every source shard tokenized on its own into
fixed-width records with a manifest, reused by content, checked on read; the held-out tail and the
training stream the same bytes as the one-``bytes`` reading (sources.corpus_bytes); bad input named.
In one process (the pool of workers is tests/system/test_token_store_s3.py's)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data import prose, text_corpus  # noqa: F401 (shared helpers)

import diloco_async.data.tokenizer as tokenizer_mod
from diloco_async.config.data import DataConfig
from diloco_async.data.sources import SourceFile, corpus_bytes, resolve_sources
from diloco_async.data.store import ShardJob, measure_shard, tokenize_shard
from diloco_async.data.tokenizer import load_tokenizer
from diloco_async.data.tokens import open_corpus, split_point

ROOT = Path(__file__).resolve().parents[2]


def cfg_for(urls: str | list[str], cache: Path, **kw) -> DataConfig:
    return DataConfig(source="urls", urls=[urls] if isinstance(urls, str) else urls, token_cache_dir=str(cache), **kw)


def jsonl_shards(folder: Path, n: int, docs: int = 20, seed: int = 0) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        with open(folder / f"s{i}.jsonl", "w") as fh:
            for j in range(docs):
                fh.write(json.dumps({"text": prose(seed + 100 * i + j, 8) + " é ü"}) + "\n")
    return f"file://{folder}/*.jsonl"


def reference(cfg: DataConfig) -> tuple[bytes, int]:
    raw = corpus_bytes(resolve_sources(cfg), cfg.text_field)
    return raw, split_point(raw, cfg.eval_fraction)


def corpus_manifest(cache: Path) -> dict:
    [path] = (cache / "store" / "corpora").glob("*.json")
    return json.loads(path.read_text())


# --------------------------------------------------------------------- the same stream ---------

def test_shakespeare_bytes_stream_is_the_one_bytes_readings(tmp_path):
    """make run's corpus: the training and held-out tokens of the sharded store are byte for byte
    the joined corpus split at the tail, as before the store."""
    cfg = DataConfig(cache_dir=str(ROOT / "data"), token_cache_dir=str(tmp_path / "c"))
    corpus = open_corpus(cfg, context=64)
    raw, cut = reference(cfg)
    assert len(resolve_sources(cfg)) == 42
    assert bytes(corpus.train) == raw[:cut] and bytes(corpus.heldout) == raw[cut:]
    assert corpus.heldout_bytes == len(raw) - cut


@pytest.mark.parametrize("eval_fraction", [0.05, 0.2, 0.37, 0.45])
def test_held_out_is_the_same_bytes_wherever_the_cut_falls(tmp_path, eval_fraction):
    """Shards of every kind (JSONL with two-byte characters, an empty JSONL, an empty text file, a
    gzipped JSONL, Parquet): the cut falls inside a shard, on a separator or inside a character, and
    the training and held-out tokens are the reference's bytes, for the bytes tokenizer and a BPE."""
    import gzip

    src = tmp_path / "src"
    jsonl_shards(src, 3, docs=7)
    (src / "s1b.jsonl").write_text("")  # no documents: no separator either
    (src / "s1c.txt").write_text("")  # one empty document
    (src / "s2z.jsonl.gz").write_bytes(gzip.compress(b"".join(
        json.dumps({"text": prose(900 + j, 5)}).encode() + b"\n" for j in range(5))))
    pq.write_table(pa.table({"text": [prose(950 + j, 6) for j in range(4)]}), src / "s3.parquet")
    urls = [f"file://{src}/s*"]  # each file's format by its name
    for tok in ("bytes", "bpe:300"):
        cfg = cfg_for(urls, tmp_path / f"c-{tok[:3]}", eval_fraction=eval_fraction, tokenizer=tok)
        corpus = open_corpus(cfg, context=8)
        raw, cut = reference(cfg)
        assert corpus.heldout_bytes == len(raw) - cut
        hf = corpus.tokenizer.hf
        train, heldout = ((bytes(a) if hf is None else hf.decode(a.tolist()).encode())
                          for a in (corpus.train, corpus.heldout))
        assert train == raw[:cut] and heldout == raw[cut:], tok


def test_a_bpe_stream_equals_encoding_the_whole_split_away_from_shard_boundaries(tmp_path):
    """What holds for a BPE: the same text, tokenized shard by shard; where documents end in a word
    (as these) the ids are those of encoding the whole training split at once."""
    cfg = cfg_for(jsonl_shards(tmp_path / "src", 4), tmp_path / "c", tokenizer="bpe:300")
    corpus = open_corpus(cfg, context=8)
    raw, cut = reference(cfg)
    assert corpus.train.tolist() == corpus.tokenizer.encode(raw[:cut]).tolist()


# --------------------------------------------------------------------- manifest and reuse ------

def test_the_manifest_names_every_shard_with_its_digests_and_counts(tmp_path):
    cache = tmp_path / "c"
    cfg = cfg_for(jsonl_shards(tmp_path / "src", 3), cache, eval_fraction=0.3)
    corpus = open_corpus(cfg, context=8)
    doc = corpus_manifest(cache)
    files = resolve_sources(cfg)
    assert [s["url"] for s in doc["shards"]] == [f.url for f in files]
    assert doc["train_tokens"] == len(corpus.train) and doc["heldout_tokens"] == len(corpus.heldout)
    total = 0
    for f, shard in zip(files, doc["shards"], strict=True):
        text = corpus_bytes([f], "text")
        assert shard["text_bytes"] == len(text) and shard["docs"] == 20
        got = b""
        for part in shard["parts"]:
            data = (cache / "store" / "shards" / f"{part['key']}.bin").read_bytes()
            assert part["token_digest"] == hashlib.sha256(data).hexdigest() and part["tokens"] == len(data)
            assert part["source_digest"] == shard["digest"] and part["source_url"] == f.url
            got += data
        assert got == text  # the parts of a shard tile its text
        total += len(shard["parts"])
    assert total == 4  # the shard the cut falls in is two parts


def test_a_second_corpus_reuses_the_tokens_of_the_shards_it_shares(tmp_path):
    cache, src = tmp_path / "c", tmp_path / "src"
    url = jsonl_shards(src, 3)
    open_corpus(cfg_for(url, cache, eval_fraction=0.1), context=8)
    shards = cache / "store" / "shards"
    before = {p.name: os.stat(p).st_mtime_ns for p in shards.glob("*.bin")}
    (src / "s3.jsonl").write_text((src / "s0.jsonl").read_text().replace("é", "è"))
    corpus = open_corpus(cfg_for(url, cache, eval_fraction=0.1), context=8)
    after = {p.name: os.stat(p).st_mtime_ns for p in shards.glob("*.bin")}
    assert all(after[name] == t for name, t in before.items()), "a shard's tokens were rewritten"
    docs = [json.loads(p.read_text()) for p in (cache / "store" / "corpora").glob("*.json")]
    [second] = [d for d in docs if len(d["shards"]) == 4]  # two corpora, two manifests
    keys = [p["key"] for s in second["shards"] for p in s["parts"]]
    assert sum(k.endswith("-all") and f"{k}.bin" in before for k in keys) == 2  # shards 0 and 1, whole in both
    raw, cut = reference(cfg_for(url, cache, eval_fraction=0.1))
    assert bytes(corpus.train) == raw[:cut]


# --------------------------------------------------------------------- refused -----------------

def test_a_tampered_or_truncated_token_file_is_refused_naming_it(tmp_path):
    cache = tmp_path / "c"
    cfg = cfg_for(jsonl_shards(tmp_path / "src", 3), cache)
    open_corpus(cfg, context=8)
    [victim] = [p for p in (cache / "store" / "shards").glob("*-all.bin")][:1]
    for damage in ("flip", "truncate"):
        for folder in (cache / "tokens").iterdir():  # the local files go: the next open reads the store
            if folder.is_dir():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x20
            match = rf"{victim.name} has sha256 [0-9a-f]{{64}} but its manifest says [0-9a-f]{{64}}"
        else:
            data = data[:-3]
            match = rf"{victim.name} holds {len(data)} bytes, its manifest says {len(data) + 3} tokens"
        victim.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=match):
            open_corpus(cfg, context=8)
        assert not list((cache / "tokens").glob("*/meta.json")), "a corpus was built from a damaged store"


def test_a_bad_jsonl_line_is_named_before_anything_is_tokenized(tmp_path):
    src = tmp_path / "src"
    url = jsonl_shards(src, 3)
    lines = (src / "s1.jsonl").read_text().splitlines()
    lines[6] = lines[6][:-5]  # a half-written record
    (src / "s1.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"s1.jsonl line 7: not JSON"):
        open_corpus(cfg_for(url, tmp_path / "c"), context=8)
    assert not (tmp_path / "c" / "store" / "shards").exists()


def test_a_parquet_file_that_does_not_parse_or_lacks_the_column_is_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": [prose(1, 30)] * 3}), src / "a.parquet")
    (src / "b.parquet").write_bytes(b"PAR1 this is not parquet at all " * 10)
    with pytest.raises(ValueError, match=r"not a readable parquet file .*/b.parquet"):
        open_corpus(cfg_for(f"file://{src}/*.parquet", tmp_path / "c"), context=8)
    pq.write_table(pa.table({"body": [prose(2, 30)]}), src / "b.parquet")
    with pytest.raises(ValueError, match=r"text_field='text': no such column in .*b.parquet \(columns: \['body'\]\)"):
        open_corpus(cfg_for(f"file://{src}/*.parquet", tmp_path / "c"), context=8)


@pytest.mark.parametrize("field,value", [("tokenize_workers", 0), ("tokenize_workers", 65),
                                         ("bpe_sample_bytes", 1000)])
def test_store_settings_out_of_bounds_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DataConfig(**{field: value})


# --------------------------------------------------------------------- bounded memory ----------

def test_a_shard_is_encoded_in_chunks_never_whole(tmp_path, monkeypatch):
    """A 2 MB text shard with 4 KiB chunks: no call to the tokenizer sees more than two chunks (the
    worker's memory is the chunk's, not the shard's), and the records are the shard's bytes."""
    path = tmp_path / "big.txt"
    path.write_bytes(prose(3, 40000).encode())
    f = SourceFile(f"file://{path}", "text", path.stat().st_size)
    tok = load_tokenizer("bytes", cache_dir=tmp_path, corpus_digest="", eval_fraction=0.1, train_text=bytes)
    seen = []
    real = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, data: seen.append(len(data)) or real(self, data))
    shard = measure_shard(f, "text")
    parts = tokenize_shard(ShardJob(f, "text", shard, str(tmp_path / "store"), tok, split_at=777_777,
                                    chunk_bytes=4096))
    assert len(seen) > 400 and max(seen) < 2 * 4096
    assert [(p.byte_start, p.byte_end) for p in parts] == [(0, 777_777), (777_777, shard.text_bytes)]
    data = b"".join((tmp_path / "store" / "shards" / f"{p.key}.bin").read_bytes() for p in parts)
    assert data == path.read_bytes()


def test_a_bpe_trains_on_a_bounded_sample_of_every_shard(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"p{i}.txt").write_text(f"shard{i} " + prose(20 + i, 9000))  # ~450 KB each
    seen = []
    real = tokenizer_mod.train_bpe
    monkeypatch.setattr(tokenizer_mod, "train_bpe", lambda text, n: seen.append(text) or real(text, n))
    cfg = cfg_for(f"file://{src}/*.txt", tmp_path / "c", tokenizer="bpe:300", bpe_sample_bytes=1 << 20)
    raw, cut = reference(cfg)
    assert cut > 1 << 20
    open_corpus(cfg, context=8)
    [sample] = seen
    assert len(sample) <= 1 << 20 and len(sample) > 0.9 * (1 << 20)
    assert all(f"shard{i} ".encode() in sample for i in range(3))
    assert raw[cut:cut + 200] not in sample  # nothing of the held-out tail
