"""The learner's inner-state spool on its own thread against a training thread (issue 17): the
optimizer's step waits until the parameters and moments it mutates are written, so the file holds
the state as captured, bit for bit; over the copy budget the step waits too. Real threads that
wait on a FIFO, so contract tier."""

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load as st_load
from test_learner_spool import one_thread, trained  # noqa: F401, F811 (shared with unit/test_learner_spool.py; fixtures among them)

from diloco_async.inner.state import InnerState, capture, restore
from diloco_async.learner.spool import StateSpooler
from diloco_async.learner.state import Shared, SpooledState


@pytest.mark.usefixtures("one_thread")
def test_the_optimizer_step_waits_for_the_spool_and_the_file_is_the_captured_state(tmp_path):
    model, opt, step = trained()
    params = dict(model.named_parameters())
    base = {0: {n: p.detach().clone() for n, p in params.items()}}
    gen = torch.Generator().manual_seed(5)
    state = capture(params, opt, gen, step=1, base_tensors=base, base_versions={0: 3}, counters={0: (1, 16, 0.1)})
    expected = {k: v.clone() for k, v in state.tensors.items()}
    shared = Shared()
    spooler = StateSpooler("a", shared)
    stepping = threading.Event()

    def before_step(*_args) -> None:
        stepping.set()
        spooler.wait_mutable()

    hook = opt.register_step_pre_hook(before_step)
    path = str(tmp_path / "state.safetensors")
    os.mkfifo(f"{path}.tmp")  # the spool thread blocks until this test reads: a spool slower than a step
    spooler.start(state, path)
    assert shared.state_spooled.is_set() and spooler.writing() and state.tensors == {}
    trainer = threading.Thread(target=step)  # the next inner step, as the training thread runs it
    trainer.start()
    assert stepping.wait(60), "the training thread never reached its optimizer step"
    time.sleep(0.3)  # the scenario: a spool slower than a step (nothing reads the FIFO yet)
    assert trainer.is_alive(), "the optimizer step did not wait for the spool"
    assert torch.equal(params["blocks.0.fc.weight"], expected["param/blocks.0.fc.weight"])
    with open(f"{path}.tmp", "rb") as fh:  # the reader lets the spool go on
        data = fh.read()
    trainer.join(60)
    spooler.join(60)
    assert not trainer.is_alive() and not spooler.writing()
    assert not torch.equal(params["blocks.0.fc.weight"], expected["param/blocks.0.fc.weight"])  # it stepped
    back = st_load(data)
    assert back.keys() == expected.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in expected.items())
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    start = {k: e["data_offsets"][0] for k, e in header.items() if k != "__metadata__"}
    mutable = [v for k, v in start.items() if k.startswith(("param/", "exp_avg"))]
    assert max(mutable) < min(v for k, v in start.items() if k.startswith("base/"))  # what steps mutate first
    job = shared.upload_queue.get_nowait()
    assert isinstance(job, SpooledState) and job.nbytes == len(data) and job.meta["step"] == 1
    assert spooler.waited_s > 0.2
    hook.remove()
    # and it restores exactly: the step after the restore equals the step taken above
    model2, opt2, step2 = trained()
    restore(InnerState(back, job.meta), dict(model2.named_parameters()), opt2, torch.Generator())
    step2()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


@pytest.mark.usefixtures("one_thread")
def test_over_the_copy_budget_the_step_waits(tmp_path):
    model, opt, step = trained()
    params = dict(model.named_parameters())
    state = capture(params, opt, torch.Generator(), step=1, base_tensors={}, base_versions={}, counters={})
    spooler = StateSpooler("a", Shared(), copy_budget_bytes=1024)
    stepping = threading.Event()

    def before_step(*_args) -> None:
        stepping.set()
        spooler.wait_mutable()

    hook = opt.register_step_pre_hook(before_step)
    path = str(tmp_path / "state.safetensors")
    os.mkfifo(f"{path}.tmp")
    spooler.start(state, path)
    trainer = threading.Thread(target=step)
    trainer.start()
    assert stepping.wait(60), "the training thread never reached its optimizer step"
    time.sleep(0.3)  # the scenario: the spool blocked on its FIFO while the step would go on
    assert trainer.is_alive() and spooler.copied_bytes == 0
    with open(f"{path}.tmp", "rb") as fh:
        fh.read()
    trainer.join(60)
    spooler.join(60)
    hook.remove()
    assert not trainer.is_alive() and spooler.waited_s > 0.2
