"""A learner's base copies live in local files, not in RAM (issue 17 item 3): Δ taken from the
file is bit for bit Δ taken from RAM, a missing or altered file raises a clear error (never a
wrong Δ), the inner-state spool writes the base from the file exactly, and the file goes with
its last reference. A learner whose parameters are on an accelerator keeps them in RAM instead
(HeldBase), with the same reads."""

import gc
import os

import pytest
import torch
from safetensors.torch import load_file

from diloco_async.codec.versions import apply_decoded
from diloco_async.inner.base_file import (
    BaseFile,
    BaseFileError,
    HeldBase,
    LazyTensor,
    base_folder,
    keep_base,
    overwrite_param,
)
from diloco_async.inner.state import capture, restore
from diloco_async.learner.rules import adopt, encoded_outer_gradient, outer_gradient
from diloco_async.learner.spool import remove_dead_spool_folders
from diloco_async.runtime.heap import release_free_memory
from diloco_async.storage.checkpoint import spool_state


def awkward(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 tensors with the values where a lossy or reordered round trip would show: -0.0,
    subnormals, the largest finite, tiny differences; plus a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 48, generator=g) * 1e3
    w.view(-1)[:6] = torch.tensor([-0.0, 1e-45, -1e-44, 3.4028235e38, 1.0000001, 1e-38])
    return {"blocks.0.w": w, "blocks.0.b": torch.randn(48, generator=g) * 1e-30,
            "scale": torch.tensor(0.5), "empty": torch.empty(0, 3)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_delta_from_the_file_is_delta_from_ram_bit_for_bit(tmp_path):
    base = awkward(0)
    theta = {n: t + torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) * 1e-3 for n, t in base.items()}
    held = BaseFile.write(base, str(tmp_path))
    from_ram, from_file = outer_gradient(base, theta), outer_gradient(held, theta)
    assert from_file.keys() == from_ram.keys()
    for n in from_ram:
        assert from_file[n].dtype == torch.float32 and from_file[n].shape == from_ram[n].shape
        assert torch.equal(bits(from_file[n]), bits(from_ram[n])), n
    enc_ram, enc_file = encoded_outer_gradient(base, theta, "bf16"), encoded_outer_gradient(held, theta, "bf16")
    assert all(torch.equal(enc_ram[k], enc_file[k]) for k in enc_ram) and enc_ram.keys() == enc_file.keys()
    # the other readers of a base: a compact delta applied to it, and the rebase rule
    decoded = {n: torch.full_like(t, 0.25) for n, t in base.items()}
    for n, t in apply_decoded(decoded, held).items():
        assert torch.equal(bits(t), bits(apply_decoded(decoded, base)[n]))
    for n, t in adopt("rebase", theta, decoded, base=held).items():
        assert torch.equal(bits(t), bits(adopt("rebase", theta, decoded, base=base)[n]))


def test_a_base_file_holds_no_tensor_in_ram(tmp_path):
    big = {"w": torch.randn(4096, 4096)}  # 64 MiB fp32
    gc.collect()
    release_free_memory()
    with open("/proc/self/statm") as fh:
        before = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    held = BaseFile.write(big, str(tmp_path))
    expected = big["w"].clone()
    del big
    gc.collect()
    release_free_memory()
    with open("/proc/self/statm") as fh:
        after = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # before counts the 64 MiB source; after counts the clone instead: the file adds (almost) nothing
    assert after - before < 16 * 2**20, f"RSS grew {(after - before) / 2**20:.0f} MiB"
    assert not any(isinstance(v, torch.Tensor) for v in gc.get_referents(held) + list(vars(held).values()))
    assert held.nbytes == 64 * 2**20 and os.path.getsize(held.path) == held.nbytes
    assert torch.equal(bits(held["w"]), bits(expected))


@pytest.mark.parametrize("damage,reason", [("flip", "checksum"), ("truncate", "short"), ("delete", "missing")])
def test_a_damaged_base_file_raises_and_never_yields_a_delta(tmp_path, damage, reason):
    base = awkward(2)
    held = BaseFile.write(base, str(tmp_path))
    if damage == "flip":
        with open(held.path, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0x01]))
    elif damage == "truncate":
        os.truncate(held.path, 64 * 48 * 4 - 8)
    else:
        os.unlink(held.path)
    theta = {n: t.clone() for n, t in base.items()}
    with pytest.raises(BaseFileError, match=r"base file .*") as err:
        outer_gradient(held, theta)
    assert err.value.reason == reason
    assert held.path in str(err.value)


def test_the_file_goes_with_its_last_reference(tmp_path):
    held = BaseFile.write(awkward(3), str(tmp_path))
    path, also = held.path, held
    del held
    gc.collect()
    assert os.path.exists(path)  # still referenced (a held version that is also the base)
    del also
    gc.collect()
    assert not os.path.exists(path)


def test_the_spool_writes_a_base_from_its_file_exactly_and_restore_reads_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 64)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 48)).sum().backward()
    opt.step()
    params = dict(model.named_parameters())
    ram = {"weight": awkward(4)["blocks.0.w"], "bias": torch.randn(64)}
    held = {0: BaseFile.write(ram, str(tmp_path))}
    state = capture(params, opt, torch.Generator(), step=3, base_tensors=held, base_versions={0: 7},
                    counters={0: (3, 96, 0.1)})
    assert all(isinstance(state.tensors[f"base/0/{n}"], LazyTensor) for n in ram)
    path = tmp_path / "state.safetensors"
    spool_state(state.tensors, path, consume=True)
    loaded = load_file(str(path))
    for n, t in ram.items():
        assert torch.equal(bits(loaded[f"base/0/{n}"]), bits(t)), n
    state.tensors = loaded
    _, bases, versions, _ = restore(state, params, opt, torch.Generator())
    assert versions == {0: 7} and all(torch.equal(bits(bases[0][n]), bits(ram[n])) for n in ram)


def test_base_folders_of_gone_processes_are_removed(tmp_path):
    mine = base_folder("lrn-x", parent=str(tmp_path))
    dead = tmp_path / "diloco-lrn-x-pid999999999-base-abc"
    dead.mkdir()
    (dead / "base-1.bin").write_bytes(b"\0" * 8)
    assert remove_dead_spool_folders("lrn-x", parent=str(tmp_path)) == [str(dead)]
    assert os.path.isdir(mine) and not dead.exists()


def test_keep_base_holds_in_ram_only_when_asked_and_reads_like_a_file():
    base = awkward(2)
    theta = {n: t + torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) * 1e-3 for n, t in base.items()}
    in_file, in_ram = keep_base(base, "lrn-h", in_ram=False), keep_base(base, "lrn-h", in_ram=True)
    assert isinstance(in_file, BaseFile) and isinstance(in_ram, HeldBase)
    assert keep_base(in_ram, "lrn-h", in_ram=False) is in_ram and keep_base(in_file, "lrn-h", in_ram=True) is in_file
    assert list(in_ram) == list(base) and len(in_ram) == len(base) and "scale" in in_ram and "nope" not in in_ram
    assert all(in_ram.shape_of(n) == in_file.shape_of(n) == tuple(t.shape) for n, t in base.items())
    assert in_ram.nbytes == in_file.nbytes
    for n in base:
        assert torch.equal(bits(in_ram[n]), bits(in_file[n])), n
    a, b = outer_gradient(in_ram, theta), outer_gradient(in_file, theta)
    assert all(torch.equal(bits(a[n]), bits(b[n])) for n in theta)
    for codec in ("int8", "bf16"):
        ea, eb = encoded_outer_gradient(in_ram, theta, codec), encoded_outer_gradient(in_file, theta, codec)
        assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    d = {n: torch.full_like(t, 0.25) for n, t in base.items()}
    new_ram, new_file = apply_decoded(d, in_ram), apply_decoded(d, in_file)
    assert all(torch.equal(bits(new_ram[n]), bits(new_file[n])) for n in d)
    moved = adopt("rebase", theta, new_ram, base=in_ram)
    assert all(torch.equal(bits(moved[n]), bits(theta[n] + (new_ram[n] - base[n]))) for n in base)
    assert all(torch.equal(bits(in_ram[n]), bits(base[n])) for n in base)  # read, never written


def test_the_spool_writes_a_base_held_in_ram_exactly(tmp_path):
    model = torch.nn.Linear(48, 64)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    params = dict(model.named_parameters())
    ram = {"weight": awkward(5)["blocks.0.w"], "bias": torch.randn(64)}
    state = capture(params, opt, torch.Generator(), step=1, base_tensors={2: HeldBase(ram)}, base_versions={2: 4},
                    counters={})
    path = tmp_path / "state.safetensors"
    spool_state(state.tensors, path, consume=True)
    loaded = load_file(str(path))
    assert all(torch.equal(bits(loaded[f"base/2/{n}"]), bits(t)) for n, t in ram.items())


def test_delta_from_a_base_file_is_taken_in_the_tensor_read_no_second_one(tmp_path, monkeypatch):
    base = awkward(6)
    theta = {n: t + 1e-3 for n, t in base.items()}
    held = BaseFile.write(base, str(tmp_path))
    read: dict[str, torch.Tensor] = {}
    lookup = BaseFile.__getitem__

    def recording(self, name):
        read[name] = lookup(self, name)
        return read[name]

    monkeypatch.setattr(BaseFile, "__getitem__", recording)
    delta = outer_gradient(held, theta)
    for n, d in delta.items():
        assert d is read[n], n  # Δ written into the tensor the file was read into
        assert torch.equal(bits(d), bits(base[n] - theta[n])), n
    theta_before = {n: t.clone() for n, t in theta.items()}
    outer_gradient(dict(base), theta)  # a plain dict of tensors is read, never written
    assert all(torch.equal(bits(base[n]), bits(awkward(6)[n])) for n in base)
    assert all(torch.equal(bits(theta[n]), bits(theta_before[n])) for n in theta)


def test_read_into_fills_a_parameter_in_place_and_checks_the_bytes(tmp_path):
    base = awkward(7)
    held = BaseFile.write(base, str(tmp_path))
    model = torch.nn.Linear(48, 64)
    weight = model.weight
    ptr = weight.data_ptr()
    held.read_into("blocks.0.w", weight)  # a parameter that requires grad: written under the hood
    assert weight.data_ptr() == ptr and weight.requires_grad
    assert torch.equal(bits(weight.detach()), bits(base["blocks.0.w"]))
    for wrong in (torch.empty(48, 64), torch.empty(64, 48, dtype=torch.float64), torch.empty(48, 64).t()):
        with pytest.raises(ValueError, match="read_into blocks.0.w"):
            held.read_into("blocks.0.w", wrong)
    with open(held.path, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff\xff")
    with pytest.raises(BaseFileError) as err:
        held.read_into("blocks.0.w", torch.empty(64, 48))
    assert err.value.reason == "checksum"


def test_an_overwrite_adoption_reads_a_base_file_into_the_parameter_without_a_lookup(tmp_path, monkeypatch):
    new = awkward(8)
    held = BaseFile.write(new, str(tmp_path))
    param = torch.nn.Parameter(torch.zeros(64, 48))

    def no_lookup(self, name):
        raise AssertionError(f"{name} was read into a new tensor")

    with monkeypatch.context() as m:
        m.setattr(BaseFile, "__getitem__", no_lookup)
        with torch.no_grad():
            overwrite_param(param, held, "blocks.0.w")
    assert torch.equal(bits(param.detach()), bits(new["blocks.0.w"]))
    # a parameter the file cannot be read into (another dtype), or a base in RAM: copied
    half = torch.zeros(64, 48, dtype=torch.bfloat16)
    overwrite_param(half, held, "blocks.0.w")
    assert torch.equal(half, new["blocks.0.w"].to(torch.bfloat16))
    in_ram = torch.zeros(48)
    overwrite_param(in_ram, HeldBase(new), "blocks.0.b")
    assert torch.equal(bits(in_ram), bits(new["blocks.0.b"]))
