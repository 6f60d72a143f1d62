"""A learner on a GPU takes Δ there and copies it to pinned host memory without a wait; it adopts
from pinned memory without a wait; its inner-state spool copies the parameters and moments on
the device and reads them on a stream of its own (issue 17). The results are bit for bit those of
the CPU path, and the upload reads Δ only once its copy is done.

The tests marked ``cuda`` run where a GPU is present (the device machine); the others check the
same functions' CPU behaviour, which is the CPU learner's path."""

import asyncio

import pytest
import torch
from safetensors.torch import load as st_load

from diloco_async.codec import wire
from diloco_async.config.schema import load_config
from diloco_async.inner.base_file import HeldBase, keep_base
from diloco_async.inner.state import capture
from diloco_async.inner.workload import Workload
from diloco_async.learner import device_copies
from diloco_async.learner.device_copies import to_host_async
from diloco_async.learner.rules import adopt, outer_gradient
from diloco_async.learner.spool import StateSpooler
from diloco_async.learner.state import Shared, UploadJob
from diloco_async.learner.uploads import Uploads
from diloco_async.storage.store import ObjectStore

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")


def fragment(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 64, generator=g) * 1e3
    w.view(-1)[:5] = torch.tensor([-0.0, 1e-45, -1e-44, 3.0e38, 1.0000001])
    return {"blocks.0.w": w, "blocks.0.b": torch.randn(64, generator=g) * 1e-30, "scale": torch.tensor(0.5)}


def nudged(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * 1e-3 for n, t in base.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def test_outer_gradient_on_thetas_device_is_the_rule_and_leaves_the_base_alone():
    """The rule moves each base tensor to θ's device: when it is there already (the CPU here) it
    is the base tensor itself, which the subtraction must not write into."""
    base, theta = fragment(0), nudged(fragment(0), 1)
    kept = {n: t.clone() for n, t in base.items()}
    got, want = outer_gradient(base, theta), {n: kept[n] - t for n, t in theta.items()}
    assert got.keys() == want.keys()
    assert all(torch.equal(bits(got[n]), bits(want[n])) for n in want)
    assert all(torch.equal(bits(base[n]), bits(kept[n])) for n in base)  # Θ^base is read, never written


def test_on_the_cpu_nothing_is_copied_and_no_event_is_waited_for():
    delta = fragment(2)
    copy = to_host_async(delta)
    assert copy.event is None and all(copy.tensors[n] is t for n, t in delta.items())
    assert to_host_async({}).tensors == {}

    class Lazy(dict):  # a base file reads a tensor when it is looked up: on the CPU none is looked up early
        reads = 0

        def __getitem__(self, name):
            Lazy.reads += 1
            return super().__getitem__(name)

    lazy, theta = Lazy(fragment(3)), nudged(fragment(3), 4)
    adopt("rebase", theta, fragment(5), base=lazy, snapshot=theta)  # rebase from its snapshot reads no base
    assert Lazy.reads == 0
    outer_gradient(lazy, theta)  # each base tensor read once, when its Δ is taken
    assert Lazy.reads == len(theta)
    with pytest.raises(ValueError, match="several devices"):
        to_host_async({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")})
    with pytest.raises(NotImplementedError):  # another device (mps) is copied to the host at once: meta cannot be
        to_host_async({"a": torch.zeros(2, device="meta")})


def test_a_held_base_is_pinned_only_for_a_cuda_device():
    base = fragment(4)
    held = keep_base(base, "lrn-p", in_ram=True, pin_device=torch.device("cpu"))
    assert isinstance(held, HeldBase) and not any(t.is_pinned() for t in held.values())
    assert all(torch.equal(bits(held[n]), bits(base[n])) for n in base)


def test_the_upload_reads_delta_only_after_its_copy_is_done(tmp_path):
    """The event stands for a copy from a GPU: the values land when it is waited for. An upload
    that did not wait would encode the zeros that were there before."""
    want = fragment(5)
    landing = {n: torch.zeros_like(t) for n, t in want.items()}

    class Copy:  # a torch.cuda.Event's interface; the copy lands when it is waited for
        waited = 0

        def synchronize(self):
            Copy.waited += 1
            for n, t in landing.items():
                t.copy_(want[n])

    store = ObjectStore(f"file://{tmp_path}/s")
    up = Uploads("a", 0, store, Shared())
    up.configure(store, "fp32", 10.0)
    job = UploadJob(0, 1, 0, 3, 48, 0.1, landing, delta_ready=Copy())
    ref = asyncio.run(up._encode_and_put(job, "run/contrib/0", {"fragment": "0"}))
    got, _ = wire.decode_from_bytes(store.get(ref), "fp32", {n: tuple(t.shape) for n, t in want.items()})
    assert Copy.waited == 1 and job.delta_ready is None
    assert all(torch.equal(bits(got[n]), bits(want[n])) for n in want)


# ---------------------------------------------------------------- on a GPU -----------------------


def tiny_workload(device: str) -> Workload:
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=2", "synchronizer.num_fragments=2"])
    torch.manual_seed(0)
    w = Workload.from_config(cfg, index=0, incarnation=0)
    w.place(torch.device(device))
    return w


def loop_on(device: str, rule: str):
    from diloco_async.learner.training import InnerLoop, StartPoint
    from diloco_async.metrics.timeline import Recorder
    from diloco_async.models import plan_of

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=2", "synchronizer.num_fragments=2", f'learners.adopt="{rule}"'])
    w = tiny_workload(device)
    plan = plan_of(w.model, 2)
    pin = torch.device(device) if device != "cpu" else None
    base = {p: keep_base({n: w.params[n].detach().cpu() + 0.5 for n in plan.names(p)}, "lrn-g", in_ram=True,
                         pin_device=pin) for p in range(2)}
    shared = Shared()
    shared.base.update({0: 0, 1: 0})
    loop = InnerLoop(cfg, shared, w, plan, Recorder(None), learner_id="lrn-g",
                     start=StartPoint(base, counters={0: (3, 48, 0.1)}, step=3))
    return loop, shared, plan


@cuda
@pytest.mark.parametrize("rule", ["overwrite", "rebase", "mix"])
def test_contribution_and_adoption_on_a_gpu_match_the_cpu(rule):
    from diloco_async.protocol.messages import VersionInfo

    results = {}
    for device in ("cpu", "cuda"):
        loop, shared, plan = loop_on(device, rule)
        if device == "cuda":
            assert all(t.is_pinned() for b in loop.base_tensors.values() for t in b.values())
        loop._contribute(0, 1)
        job = shared.upload_queue.get_nowait()
        assert (job.delta_ready is None) == (device == "cpu")
        if job.delta_ready is not None:
            assert all(t.is_pinned() and t.device.type == "cpu" for t in job.delta.values())
            job.delta_ready.synchronize()
        new = keep_base({n: t.cpu() * 0.75 for n, t in loop.base_tensors[0].items()}, "lrn-g", in_ram=True,
                        pin_device=torch.device(device) if device != "cpu" else None)
        v = VersionInfo(fragment=0, version=1, key="k", nbytes=1, sha256="0" * 64)
        shared.adopt_queue.put((v, new))
        assert loop._adopt_arrivals() == [0]
        results[device] = ({n: t.clone() for n, t in job.delta.items()},
                           {n: loop.workload.params[n].detach().cpu() for n in plan.names(0)})
    (d_cpu, p_cpu), (d_gpu, p_gpu) = results["cpu"], results["cuda"]
    assert all(torch.equal(bits(d_gpu[n]), bits(d_cpu[n])) for n in d_cpu)
    for n in p_cpu:
        if rule == "mix":  # (1 − α)·θ + α·Θ^new: a GPU may fuse the multiply-add
            torch.testing.assert_close(p_gpu[n], p_cpu[n], rtol=2e-7, atol=0)
        else:
            assert torch.equal(bits(p_gpu[n]), bits(p_cpu[n])), n


@cuda
@pytest.mark.parametrize("room", ["fits", "none"])
def test_a_gpu_spool_writes_the_captured_state_while_training_mutates_it(tmp_path, monkeypatch, room):
    """With room on the device the spool copies the parameters and moments there and the step
    never waits; without, the step waits for them as on the CPU. The file is the captured state."""
    if room == "none":
        monkeypatch.setattr(device_copies, "device_free_bytes", lambda _device: 0)
    w = tiny_workload("cuda")
    w.shard = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    w.step(0)
    base = {0: keep_base({n: p.detach().cpu() for n, p in w.params.items()}, "lrn-s", in_ram=True,
                         pin_device=torch.device("cuda"))}
    state = capture(w.params, w.optimizer, w.generator, step=1, base_tensors=base, base_versions={0: 2},
                    counters={0: (1, 16, 0.1)})
    expected = {k: v.detach().cpu().clone() for k, v in state.tensors.items()}
    shared = Shared()
    spooler = StateSpooler("lrn-s", shared)

    def before_step(*_args) -> None:  # as the learner's InnerLoop does
        spooler.wait_mutable()

    hook = w.optimizer.register_step_pre_hook(before_step)
    spooler.start(state, str(tmp_path / "state.safetensors"))
    for step in range(1, 4):  # the optimizer mutates parameters and moments while the spool runs
        w.step(step)
    spooler.join()
    hook.remove()
    spooled = shared.upload_queue.get_nowait()
    got = st_load((tmp_path / "state.safetensors").read_bytes())
    assert spooled.meta["step"] == 1 and got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    name = next(iter(w.params))
    assert not torch.equal(w.params[name].detach().cpu(), expected[f"param/{name}"])  # training went on
    if room == "fits":
        assert spooler.waited_s == 0.0
