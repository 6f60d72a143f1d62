"""A real run on a BPE tokenizer: a synchronizer and two learner processes train a byte-GPT whose
vocabulary is the tokenizer's, on three Shakespeare plays tokenized once into the shared cache;
the held-out loss falls in nats per token and in bits per byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from diloco_async.config.schema import load_config
from diloco_async.data.tokens import open_corpus
from diloco_async.metrics.evaluation import heldout_loss, heldout_split, model_from_checkpoint
from diloco_async.models.transformer import ByteGPT
from diloco_async.run import RunProcesses
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.sync import initial_parameters

PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")


def test_two_learners_train_on_a_bpe_tokenizer(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in PLAYS:
        shutil.copy(Path("data/shakespeare").resolve() / name, texts / name)
    overrides = [
        f"run.store=file://{tmp_path}/store", f"run.workdir={tmp_path}/runs", 'data.source="urls"',
        f'data.urls=["file://{texts}/*.txt"]', 'data.tokenizer="bpe:512"', f'data.token_cache_dir="{tmp_path}/cache"',
        "model.vocab_size=512", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=32",
        "learners.count=2", "learners.batch_size=8", "synchronizer.num_fragments=3", "synchronizer.sync_every=12",
        "synchronizer.checkpoint_every_s=2", "budget.tokens=80000", "budget.wall_s=150",
    ]
    cfg = load_config("configs/default.toml", overrides)
    corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)  # as the flow prepares it
    assert corpus.vocab_size == 512 and corpus.heldout_bytes > 1.5 * len(corpus.heldout)

    run = RunProcesses(cfg)
    try:
        run.start_synchronizer()
        for i in range(2):
            run.start_learner(i)
        assert run.sync.wait(timeout=240) == 0, run.sync.log_path.read_text()[-3000:]
        run.finished_cleanly = True
    finally:
        run.stop_all()
    for i in range(2):
        log = (run.workdir / "logs" / f"learner-{i}.log").read_text()
        assert f"shard {i}/2 of {len(corpus.shard(i, 2))} tokens" in log, log[-2000:]
        assert "trained bpe:512" not in log  # the learners mapped the prepared cache; nobody retrained
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 1

    split = heldout_split(cfg)
    assert split.nbytes == corpus.heldout_bytes and split.tokens == len(corpus.heldout)
    model0 = ByteGPT(cfg.model)
    model0.load_state_dict(initial_parameters(cfg)[0], strict=False)
    start = heldout_loss(model0, split.batches)
    final = heldout_loss(model_from_checkpoint(cfg, latest_checkpoint(run.store, run.run_id)), split.batches)
    assert start == pytest.approx(6.24, abs=0.3)  # about ln 512 nats/token before training
    assert final < start - 0.5
    assert split.bits_per_byte(final) == pytest.approx(final * split.tokens / (split.nbytes * 0.6931471805599453))
    assert split.bits_per_byte(final) < split.bits_per_byte(start) - 0.1


@pytest.mark.parametrize("bad, error, named", [
    (['data.source="urls"', 'data.urls=["file:///nonexistent/corpus-*.jsonl"]'], FileNotFoundError,
     "/nonexistent/corpus-"),
    (['data.tokenizer="bpe:512"'], ValueError, "data.tokenizer='bpe:512' has 512 tokens but model.vocab_size=256"),
])
def test_the_train_flow_refuses_bad_data_before_anything_starts(prefect_server, tmp_path, bad, error, named):
    from diloco_async.flows.train import train

    overrides = [f"run.store=file://{tmp_path}/store", f"run.workdir={tmp_path}/runs",
                 f'data.token_cache_dir="{tmp_path}/cache"', f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db",
                 *bad]
    with pytest.raises(error, match=named):
        train(config="configs/default.toml", overrides=overrides)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()  # no process was started
    assert not (tmp_path / "cache" / "tokenizers").exists()  # nor a BPE trained
