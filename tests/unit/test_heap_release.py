"""When the learner's training thread hands the C heap's free pages back
(:class:`diloco_async.runtime.heap.ReleaseWhenItPays`, issue 17): pure, fed resident sizes in MiB."""

from __future__ import annotations

import pytest

from diloco_async.runtime.heap import ReleaseWhenItPays

MiB = 1 << 20


def _drive(policy: ReleaseWhenItPays, step_buffers_mib: int, leftover_mib: int, steps: int) -> tuple[int, int]:
    """A loop whose steps reuse ``step_buffers_mib`` of free heap and whose comms thread frees
    buffers before every step, of which ``leftover_mib`` stay resident unless released; returns the
    releases and the most leftovers (MiB) held. The resident size: 500 MiB in use, the step's
    buffers (faulted back in by every step), the leftovers."""
    leftovers, most, releases = 0, 0, 0
    for _ in range(steps):
        leftovers += leftover_mib
        most = max(most, leftovers)
        if policy.after_step((500 + step_buffers_mib + leftovers) * MiB, freed=True):
            releases += 1
            leftovers = 0  # everything free goes back, the step's buffers too
            policy.released(500 * MiB)
    return releases, most


def test_a_loop_whose_steps_dwarf_its_fragments_releases_rarely():
    """The HF Llama recipe's shape: a 21 MB model, ~200 MiB of step buffers, a few MiB left over
    per round. Each release faults 200 MiB back and keeps little: it stops paying, and the skips
    double up to ``max_skip``."""
    policy = ReleaseWhenItPays(21 * MiB, 16 * MiB, max_skip=64)
    releases, _ = _drive(policy, step_buffers_mib=200, leftover_mib=1, steps=1000)
    assert policy.paid == 0
    assert policy.skip == 64
    assert releases <= 1 + 7 + 1000 // 64  # the first, then 1, 2, 4, ... 64 chances skipped
    assert policy.last_faulted_bytes == 201 * MiB  # the step's buffers and one step's leftovers


def test_a_loop_whose_fragments_dominate_releases_at_every_chance():
    """The 25M ByteGPT shape: ~80 MiB of step buffers against a 97 MiB model. Each release faults
    back less than the model's size: cheap, so every chance is taken and leftovers never pile up."""
    policy = ReleaseWhenItPays(97 * MiB, 16 * MiB)
    assert _drive(policy, step_buffers_mib=80, leftover_mib=12, steps=100) == (100, 12)
    assert policy.paid == 99 and policy.skip == 0


def test_leftovers_that_pile_up_while_releases_are_skipped_are_released():
    """Step buffers of 200 MiB (expensive to fault back) and 40 MiB left over per step: once the
    skipped chances let enough pile up, a release keeps more than half of what it faults back and
    pays, which resets the skips. The leftovers stay bounded; judged on what is faulted back
    alone, the skips would reach 64 and the leftovers 40 x 64 MiB."""
    policy = ReleaseWhenItPays(21 * MiB, 16 * MiB)
    releases, most = _drive(policy, step_buffers_mib=200, leftover_mib=40, steps=500)
    assert policy.paid >= 10 and releases >= 50
    assert most <= 40 * 9, most


def test_skips_reset_once_a_release_pays_again():
    policy = ReleaseWhenItPays(10 * MiB, 16 * MiB)
    assert policy.after_step(700 * MiB, freed=True)
    policy.released(500 * MiB)
    assert not policy.after_step(700 * MiB, freed=True)  # faulted back 200, kept 0: skip the next one
    assert policy.skip == 1
    assert policy.after_step(700 * MiB, freed=True)
    policy.released(500 * MiB)
    assert not policy.after_step(705 * MiB, freed=False)  # judged: no pay, skip 2; no chance anyway
    assert policy.skip == 2
    assert not policy.after_step(700 * MiB, freed=True)
    assert not policy.after_step(700 * MiB, freed=True)
    assert policy.after_step(900 * MiB, freed=True)  # the heap grew by 200 MiB of leftovers
    policy.released(500 * MiB)
    assert not policy.after_step(600 * MiB, freed=False)  # faulted back 100, kept 300
    assert policy.skip == 0 and policy.paid == 1
    assert policy.after_step(600 * MiB, freed=True)


def test_no_chance_no_release():
    """Without large frees since the last step there is nothing to release, however large the heap."""
    policy = ReleaseWhenItPays(0, 0)
    assert not any(policy.after_step(n * 100 * MiB, freed=False) for n in range(1, 20))
    assert policy.releases == 0


@pytest.mark.parametrize("args", [(-1, 0), (0, -1), (0, 0, 0)])
def test_bad_settings_are_refused(args):
    cheap, gain, *rest = args
    with pytest.raises(ValueError, match="must be"):
        ReleaseWhenItPays(cheap, gain, **({"max_skip": rest[0]} if rest else {}))
