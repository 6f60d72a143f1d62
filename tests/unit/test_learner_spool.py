"""The learner's inner-state spool runs on its own thread while training goes on (issue 17): the
file holds the state as captured, bit for bit, because the optimizer's step waits until the
parameters and moments it mutates are written; the base copies are written after, without a wait."""

import hashlib
import os
import threading

import pytest
import torch
from safetensors.torch import load as st_load

from diloco_async.config.schema import ModelConfig
from diloco_async.inner.state import InnerState, capture
from diloco_async.learner.spool import MUTABLE_PREFIXES, StateSpooler
from diloco_async.learner.state import Shared
from diloco_async.models.transformer import ByteGPT
from diloco_async.storage.checkpoint import write_state_file
from diloco_async.storage.store import ObjectStore


def trained():
    torch.manual_seed(0)
    model = ByteGPT(ModelConfig(n_layer=1, d_model=32, n_head=2, context=8))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, 256, (2, 9))

    def step():
        opt.zero_grad()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()

    step()
    return model, opt, step


@pytest.fixture
def one_thread():
    """One intra-op thread, as learners run: a multi-threaded CPU backward (attention) may sum in another
    order from run to run, and this test compares two steps bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_failed_spool_releases_training_and_allows_the_next(tmp_path):
    shared = Shared()
    spooler = StateSpooler("a", shared)
    bad = InnerState({"base/0/w": torch.ones(4), "param/w": torch.tensor([1.0, float("nan")])}, {"step": 2})
    path = str(tmp_path / "bad.safetensors")
    spooler.start(bad, path)
    assert spooler.wait_mutable() >= 0.0
    spooler.join(10)
    assert not shared.state_spooled.is_set() and shared.upload_queue.empty()
    assert not os.path.exists(path) and not os.path.exists(f"{path}.tmp")
    spooler.start(InnerState({"param/w": torch.ones(4)}, {"step": 3}), path)
    spooler.join(10)
    assert shared.state_spooled.is_set() and os.path.getsize(path) == shared.upload_queue.get_nowait().nbytes


def test_the_spooled_state_is_uploaded_one_part_at_a_time(tmp_path):
    """A learner saves its inner state in the background: one part in flight, not the store's
    ``max_concurrency`` (each held a part of memory on top of training)."""
    store = ObjectStore(f"file://{tmp_path}/s", part_nbytes=256 << 10, max_concurrency=4)
    data = os.urandom(5 * (256 << 10) + 77)
    src = tmp_path / "state.bin"
    src.write_bytes(data)

    def part_threads() -> int:
        return sum(t.name.startswith("storage-part") for t in threading.enumerate())

    for concurrency, threads in ((None, 1), (1, 0)):
        with store.open_writer(f"o{concurrency}", len(data), max_concurrency=concurrency) as w:
            for i in range(0, len(data), 100_000):
                w.write(data[i:i + 100_000])
            assert (part_threads() > 0) == bool(threads)
        assert store.get(w.ref) == data
    ref = write_state_file(store, "run/learners/a", 1, src, {"inner": {"step": 1}})
    assert store.get_json(ref.key)["state"]["sha256"] == hashlib.sha256(data).hexdigest()


def test_within_the_copy_budget_the_step_copies_what_is_not_spooled_yet_and_goes_on(tmp_path, one_thread):
    """The optimizer step copies the parameters and moments the spool has not read yet (they fit in
    ``copy_budget_bytes``) rather than wait for them; the file still holds the captured state."""
    model, opt, step = trained()
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(5)
    state = capture(params, opt, gen, step=1, base_tensors={0: {n: p.detach().clone() for n, p in params.items()}},
                    base_versions={0: 3}, counters={0: (1, 16, 0.1)})
    expected = {k: v.clone() for k, v in state.tensors.items()}
    mutable_bytes = sum(v.numel() * v.element_size() for k, v in expected.items() if k.startswith(MUTABLE_PREFIXES))
    spooler = StateSpooler("a", Shared(), copy_budget_bytes=mutable_bytes)
    hook = opt.register_step_pre_hook(lambda *_args: spooler.wait_mutable() and None)
    path = str(tmp_path / "state.safetensors")
    os.mkfifo(f"{path}.tmp")  # the spool thread blocks (before its first tensor) until this test reads
    spooler.start(state, path)
    trainer = threading.Thread(target=step)
    trainer.start()
    trainer.join(5)
    assert not trainer.is_alive(), "the optimizer step waited for the spool"
    assert spooler.copied_bytes == mutable_bytes
    assert not torch.equal(params["blocks.0.fc.weight"], expected["param/blocks.0.fc.weight"])  # it stepped
    with open(f"{path}.tmp", "rb") as fh:
        data = fh.read()
    spooler.join(10)
    hook.remove()
    back = st_load(data)
    assert back.keys() == expected.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in expected.items())


def test_lower_thread_priority_renices_only_the_calling_thread():
    from diloco_async.runtime.priority import lower_thread_priority

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["new"] = lower_thread_priority(3)
        seen["before"], seen["after"] = before, os.getpriority(os.PRIO_PROCESS, tid)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(10)
    assert seen["new"] == seen["after"] == min(19, seen["before"] + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
