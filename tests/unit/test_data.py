"""Data side: sources (text, JSONL, Parquet by fsspec URL or glob), tokenizers (bytes, tokenizer.json,
a BPE trained once and cached), the shared token cache, the fixed held-out split, bits per byte,
and every bad input refused with a message naming the value."""

from __future__ import annotations

import json
import math
import random
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import diloco_async.data.tokenizer as tokenizer_mod
from diloco_async.config.data import DataConfig
from diloco_async.config.schema import load_config
from diloco_async.data.sources import corpus_bytes, resolve_sources
from diloco_async.data.tokenizer import check_vocab, train_bpe
from diloco_async.data.tokens import Corpus, bits_per_byte, open_corpus, split_point

WORDS = ("the king queen lord lady sword crown love death night day speak hear thou thee thy good noble "
         "fair heaven earth father mother son daughter honour grace war peace blood heart").split()


def prose(seed: int, n_lines: int = 600) -> str:
    """Deterministic pseudo-English: lines of words from a small vocabulary (BPE finds merges)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice(".,;!?"))
    return "\n".join(lines)


def text_corpus(folder: Path, n_files: int = 2, n_lines: int = 600) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (folder / f"part-{i}.txt").write_text(prose(i, n_lines))
    return f"file://{folder}/*.txt"


def data_cfg(urls: str | list[str], cache: Path, **kw) -> DataConfig:
    return DataConfig(source="urls", urls=[urls] if isinstance(urls, str) else urls, token_cache_dir=str(cache), **kw)


def mem_url(name: str) -> str:
    return f"memory://test-data-{uuid.uuid4().hex[:8]}/{name}"


# --------------------------------------------------------------------- bits per byte ----------

def test_bits_per_byte_on_known_numbers():
    assert bits_per_byte(2.0, 100, 300) == pytest.approx(2.0 * 100 / (300 * math.log(2)))
    assert bits_per_byte(math.log(256), 1000, 1000) == pytest.approx(8.0)  # uniform over bytes: 8 bits
    with pytest.raises(ValueError, match="positive counts"):
        bits_per_byte(1.0, 0, 10)


def test_bytes_tokenizer_bits_per_byte_is_nats_per_byte_over_ln2(tmp_path):
    corpus = open_corpus(data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c"), context=16)
    split = corpus.heldout_split(batch_size=4, n_batches=2)
    assert split.tokens == split.nbytes == len(corpus.heldout)
    assert split.bits_per_byte(1.5) == pytest.approx(1.5 / math.log(2))


# --------------------------------------------------------------------- sources ----------------

def test_text_files_are_the_joined_bytes_split_at_the_tail(tmp_path):
    url = text_corpus(tmp_path / "t")
    cfg = data_cfg(url, tmp_path / "c", eval_fraction=0.1)
    raw = b"\n".join((tmp_path / "t" / f"part-{i}.txt").read_bytes() for i in range(2))
    assert corpus_bytes(resolve_sources(cfg), cfg.text_field) == raw
    corpus = open_corpus(cfg, context=16)
    cut = len(raw) - int(len(raw) * 0.1)
    assert bytes(corpus.train) == raw[:cut] and bytes(corpus.heldout) == raw[cut:]
    assert corpus.heldout_bytes == len(raw) - cut and corpus.vocab_size == 256


def test_jsonl_field_by_glob(tmp_path):
    docs = [prose(i, 40) for i in range(6)]
    base = mem_url("jsonl")
    for shard in range(2):
        with fsspec.open(f"{base}/shard-{shard}.jsonl", "w") as fh:
            for d in docs[shard * 3:(shard + 1) * 3]:
                fh.write(json.dumps({"id": len(d), "content": d}) + "\n\n")  # blank lines are skipped
    cfg = data_cfg(f"{base}/*.jsonl", tmp_path / "c", text_field="content")
    files = resolve_sources(cfg)
    assert [f.format for f in files] == ["jsonl", "jsonl"]
    assert corpus_bytes(files, "content") == "\n".join(docs).encode()
    corpus = open_corpus(cfg, context=16)
    assert bytes(corpus.train) + bytes(corpus.heldout) == "\n".join(docs).encode()


def test_compressed_jsonl_by_folder(tmp_path):
    import gzip

    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "docs.jsonl.gz").write_bytes(gzip.compress(b'{"text": "' + b"ab " * 300 + b'"}\n'))
    cfg = data_cfg(f"file://{tmp_path}/z", tmp_path / "c")  # a folder: every file under it
    files = resolve_sources(cfg)
    assert [f.format for f in files] == ["jsonl"]
    assert corpus_bytes(files, "text") == b"ab " * 300


def test_parquet_column_by_glob(tmp_path):
    docs = [prose(10 + i, 40) for i in range(6)]
    folder = tmp_path / "pq"
    folder.mkdir()
    for shard in range(2):
        table = pa.table({"title": [f"doc {i}" for i in range(3)], "body": docs[shard * 3:(shard + 1) * 3]})
        pq.write_table(table, folder / f"part-{shard}.parquet")
    cfg = data_cfg(f"file://{folder}/part-*.parquet", tmp_path / "c", text_field="body")
    assert [f.format for f in resolve_sources(cfg)] == ["parquet", "parquet"]
    corpus = open_corpus(cfg, context=16)
    assert bytes(corpus.train) + bytes(corpus.heldout) == "\n".join(docs).encode()


# --------------------------------------------------------------------- tokenizers -------------

def test_bpe_is_trained_once_and_cached(tmp_path, monkeypatch):
    calls = []
    real = tokenizer_mod.train_bpe
    monkeypatch.setattr(tokenizer_mod, "train_bpe", lambda text, n: calls.append(len(text)) or real(text, n))
    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer="bpe:300")
    first = open_corpus(cfg, context=16, model_vocab=300)
    second = open_corpus(cfg, context=16, model_vocab=300)
    assert len(calls) == 1, "the second call retrained the BPE"
    raw = corpus_bytes(resolve_sources(cfg), "text")
    assert calls[0] == split_point(raw, cfg.eval_fraction)  # trained on the training split only
    assert first.tokenizer.digest == second.tokenizer.digest and first.vocab_size == 300
    assert first.train.dtype == np.uint16 and len(first.train) < 0.7 * split_point(raw, cfg.eval_fraction)
    assert first.tokenizer.hf.decode(first.heldout.tolist()).encode() == raw[split_point(raw, cfg.eval_fraction):]
    other = open_corpus(data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer="bpe:320"), context=16)
    assert len(calls) == 2 and other.tokenizer.digest != first.tokenizer.digest  # the vocab size is in the key


@pytest.mark.parametrize("where", ["memory", "file"])
def test_tokenizer_json_from_a_url(tmp_path, where):
    hf = train_bpe(prose(99, 800).encode(), 280)
    url = mem_url("tok/tokenizer.json") if where == "memory" else f"file://{tmp_path}/tokenizer.json"
    with fsspec.open(url, "w") as fh:
        fh.write(hf.to_str())
    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer=url)
    corpus = open_corpus(cfg, context=16, model_vocab=280)
    assert corpus.vocab_size == hf.get_vocab_size() == 280 and corpus.tokenizer.json_path == url
    raw = corpus_bytes(resolve_sources(cfg), "text")
    ids = hf.encode(raw[:split_point(raw, cfg.eval_fraction)].decode(), add_special_tokens=False).ids
    assert corpus.train.tolist() == ids


def test_heldout_split_is_fixed_and_covers_the_same_bytes_for_every_tokenizer(tmp_path):
    folder = tmp_path / "t"
    url = text_corpus(folder)
    cfg_b = data_cfg(url, tmp_path / "c", eval_fraction=0.05)
    cfg_t = data_cfg(url, tmp_path / "c", eval_fraction=0.05, tokenizer="bpe:300")
    for pad in range(4):  # make the byte cut fall inside a two-byte character
        (folder / "part-9.txt").write_text("x" * pad + "é" * 4000)
        raw = corpus_bytes(resolve_sources(cfg_b), "text")
        naive = len(raw) - int(len(raw) * 0.05)
        if raw[naive] & 0xC0 == 0x80:
            break
    assert split_point(raw, 0.05) == naive - 1
    cut = naive - 1
    byte_c, bpe_c = open_corpus(cfg_b, context=16), open_corpus(cfg_t, context=16)
    assert byte_c.heldout_bytes == bpe_c.heldout_bytes == len(raw) - cut
    assert bpe_c.tokenizer.hf.decode(bpe_c.heldout.tolist()).encode() == bytes(byte_c.heldout) == raw[cut:]
    two, four = byte_c.heldout_split(4, 3), byte_c.heldout_split(4, 3)  # no learner count anywhere
    assert all(torch.equal(a[0], b[0]) for a, b in zip(two.batches, four.batches, strict=True))
    shards = [byte_c.shard(i, 3) for i in range(3)]
    assert sum(len(s) for s in shards) == len(byte_c.train)  # the shards tile the training split only
    x, y = Corpus.sample(shards[1], 4, 16, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


# --------------------------------------------------------------------- bad input --------------

def test_a_url_that_matches_nothing_is_named(tmp_path):
    url = f"file://{tmp_path}/nothing-*.txt"
    with pytest.raises(FileNotFoundError, match="nothing-"):
        open_corpus(data_cfg(url, tmp_path / "c"), context=16)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        open_corpus(data_cfg(mem_url("missing.jsonl"), tmp_path / "c"), context=16)


def test_a_url_that_matches_only_empty_files_is_named(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.txt").write_bytes(b"")
    (tmp_path / "e" / "b.txt").write_bytes(b"")
    good = text_corpus(tmp_path / "t")
    with pytest.raises(ValueError, match=r"e/\*\.txt.*only empty files"):
        open_corpus(data_cfg([good, f"file://{tmp_path}/e/*.txt"], tmp_path / "c"), context=16)


def test_an_absent_jsonl_field_or_parquet_column_is_named(tmp_path):
    url = mem_url("docs.jsonl")
    with fsspec.open(url, "w") as fh:
        fh.write(json.dumps({"text": "a" * 200}) + "\n" + json.dumps({"body": "b" * 200}) + "\n")
    with pytest.raises(ValueError, match=r"data.text_field='text': no such field in .*docs.jsonl line 2"):
        open_corpus(data_cfg(url, tmp_path / "c"), context=16)
    pq.write_table(pa.table({"body": ["x" * 500]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"data.text_field='content': no such column .*\['body'\]"):
        open_corpus(data_cfg(f"file://{tmp_path}/d.parquet", tmp_path / "c", text_field="content"), context=16)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "train_bpe", lambda *a: pytest.fail("trained a BPE before checking"))
    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer="bpe:512")
    with pytest.raises(ValueError, match=r"data.tokenizer='bpe:512' has 512 tokens but model.vocab_size=256"):
        open_corpus(cfg, context=16, model_vocab=256)
    with pytest.raises(ValueError, match="has 300 tokens but config.vocab_size=128"):
        check_vocab(300, 128, model_field="config.vocab_size")  # the check an HF model's builder calls
    check_vocab(300, 300)  # equal is fine
    with pytest.raises(ValueError, match="has 256 tokens but model.vocab_size=100"):
        open_corpus(data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c"), context=16, model_vocab=100)


def test_a_tokenizer_json_larger_than_the_model_is_refused_after_loading(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(train_bpe(prose(1, 800).encode(), 290).to_str())
    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer=str(path))
    with pytest.raises(ValueError, match=r"tokenizer.json' has 290 tokens but model.vocab_size=256"):
        open_corpus(cfg, context=16, model_vocab=256)


@pytest.mark.parametrize("spec", ["gpt2", "bpe:abc", "bpe:100", "sentencepiece:8000", "tok.txt"])
def test_an_unknown_tokenizer_spec_is_named_at_config_load(spec):
    with pytest.raises(ValueError, match=f"data.tokenizer='{spec}'"):
        load_config(None, [f'data.tokenizer="{spec}"'])


def test_a_missing_or_broken_tokenizer_json_is_named(tmp_path):
    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer=f"{tmp_path}/nope/tokenizer.json")
    with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
        open_corpus(cfg, context=16)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="bad.json is not a tokenizers tokenizer.json"):
        open_corpus(data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer=str(tmp_path / "bad.json")),
                    context=16)


def test_a_corpus_too_small_for_the_learners_is_named(tmp_path):
    cfg = data_cfg(text_corpus(tmp_path / "t", n_lines=30), tmp_path / "c")
    corpus = open_corpus(cfg, context=16)
    with pytest.raises(ValueError, match="learners.count=200"):
        corpus.shard(0, 200)


def test_a_trained_bpe_saved_beside_an_hf_model_loads_back_with_autotokenizer(tmp_path):
    """The hf artifact carries the run's tokenizer: AutoTokenizer.from_pretrained on the folder
    gives the ids the run trained on; the bytes tokenizer has nothing to save."""
    from transformers import AutoTokenizer

    from diloco_async.data.tokenizer import END_OF_TEXT, transformers_tokenizer
    from diloco_async.models import ModelConfig, build_model, save_final_model

    cfg = data_cfg(text_corpus(tmp_path / "t"), tmp_path / "c", tokenizer="bpe:300")
    corpus = open_corpus(cfg, context=16, model_vocab=300)
    model_cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": {"architecture": "llama", "config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4}}})
    out = save_final_model(build_model(model_cfg, 300, seed=0), model_cfg, tmp_path / "artifact",
                           tokenizer=transformers_tokenizer(corpus.tokenizer))
    back = AutoTokenizer.from_pretrained(str(out))
    text = prose(7, 20)
    assert back(text, add_special_tokens=False)["input_ids"] == corpus.tokenizer.encode(text.encode()).tolist()
    assert back.eos_token == END_OF_TEXT and len(back) == corpus.vocab_size
    assert transformers_tokenizer(open_corpus(data_cfg(text_corpus(tmp_path / "b"), tmp_path / "c2"),
                                              context=16).tokenizer) is None
