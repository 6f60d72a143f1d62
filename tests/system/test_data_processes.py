"""The data side across processes: three processes asking for the same BPE at once train it once and
agree, and every learner maps the token file instead of copying it (the sources, tokenizers and
bad inputs in one process are tests/unit/test_data.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from test_data import WORDS, data_cfg, prose, text_corpus  # noqa: F401, F811 (shared with unit/test_data.py; fixtures among them)

from diloco_async.data.tokens import open_corpus

ROOT = Path(__file__).resolve().parents[2]


_CONCURRENT = textwrap.dedent("""
    import hashlib, json, pathlib, sys, time
    import diloco_async.data.tokenizer as t
    from diloco_async.config.data import DataConfig
    from diloco_async.data.tokens import open_corpus
    calls = []
    real = t.train_bpe
    t.train_bpe = lambda text, n: calls.append(1) or real(text, n)
    cfg = DataConfig(source="urls", urls=[sys.argv[1]], token_cache_dir=sys.argv[2], tokenizer="bpe:300")
    barrier = pathlib.Path(sys.argv[3])  # start together: every process is ready before any opens the corpus
    (barrier / sys.argv[4]).touch()
    while len(list(barrier.iterdir())) < int(sys.argv[5]):
        time.sleep(0.01)
    c = open_corpus(cfg, context=16, model_vocab=300)
    print(json.dumps({"trained": len(calls), "tokenizer": c.tokenizer.digest,
                      "train": hashlib.sha256(c.train.tobytes()).hexdigest(), "file": str(c.train.filename)}))
""")


def test_concurrent_first_calls_train_once_and_agree(tmp_path):
    url, cache, barrier = text_corpus(tmp_path / "t", n_lines=2000), tmp_path / "c", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, url, str(cache), str(barrier), str(i), "3"],
                              cwd=ROOT, text=True, stdout=subprocess.PIPE) for i in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sum(o["trained"] for o in outs) == 1
    assert len({(o["tokenizer"], o["train"], o["file"]) for o in outs}) == 1
    assert len(list((cache / "tokens").glob("*/meta.json"))) == 1


# --------------------------------------------------------------------- cache and splits -------

_MAPPER = textwrap.dedent("""
    import json, sys
    import numpy as np, psutil
    from diloco_async.config.data import DataConfig
    from diloco_async.data.tokens import open_corpus
    cfg = DataConfig(source="urls", urls=[sys.argv[1]], token_cache_dir=sys.argv[2])
    m = psutil.Process().memory_info()
    before = m.rss - m.shared
    c = open_corpus(cfg, context=16)
    total = int(np.asarray(c.train).sum(dtype=np.uint64))  # touch every page of the shard file
    m = psutil.Process().memory_info()
    print(json.dumps({"anon_growth": m.rss - m.shared - before, "memmap": isinstance(c.train, np.memmap),
                      "file": str(c.train.filename), "sum": total}))
""")


def test_token_file_is_mapped_by_every_learner_not_copied(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "a.txt").write_bytes(prose(5, 2000).encode() * 40)  # ~2.5 MB (x2 files)
    (folder / "b.txt").write_bytes(prose(6, 2000).encode() * 40)
    url, cache = f"file://{folder}/*.txt", tmp_path / "c"
    size = open_corpus(data_cfg(url, cache), context=16).train.nbytes
    procs = [subprocess.Popen([sys.executable, "-c", _MAPPER, url, str(cache)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE) for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(o["memmap"] for o in outs) and len({(o["file"], o["sum"]) for o in outs}) == 1
    for o in outs:  # the pages are the page cache's, not private copies
        assert o["anon_growth"] < size / 10, f"a learner copied the token file: +{o['anon_growth']} of {size} bytes"
