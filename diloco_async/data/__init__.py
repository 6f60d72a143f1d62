"""Where the text comes from and how it becomes tokens (DESIGN §3, docs/data-and-models.md).

:mod:`~diloco_async.data.sources` reads the bundled corpus or text, JSONL and Parquet files by
fsspec URL; :mod:`~diloco_async.data.tokenizer` builds the tokenizer (bytes, a
``tokenizer.json``, or a byte-level BPE trained once); :mod:`~diloco_async.data.store` tokenizes
each source shard on its own into the token store, :mod:`~diloco_async.data.build` runs the worker
pool and joins the parts into the token files that :mod:`~diloco_async.data.tokens` memory-maps in
every process.
"""
