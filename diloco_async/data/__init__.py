"""Where the text comes from and how it becomes tokens (DESIGN §3, docs/data-and-models.md).

:mod:`~diloco_async.data.sources` reads the bundled corpus or text, JSONL and Parquet files by
fsspec URL; :mod:`~diloco_async.data.tokenizer` builds the tokenizer (bytes, a
``tokenizer.json``, or a byte-level BPE trained once); :mod:`~diloco_async.data.tokens` writes
the token files once and memory-maps them in every process.
"""
