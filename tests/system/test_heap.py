"""The learner process's C heap settings (``diloco_async/runtime/heap.py``, issue 17), seen from its RSS:
a training step's buffers stay mapped from one step to the next, and a fragment-sized buffer
still goes back to the system when it is freed. Each probe is a fresh learner process (the
settings are process-wide), set up by ``main`` before it refuses to start without a token."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from diloco_async.protocol.client import LEARNER_TOKEN_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="the settings are glibc's")

_PROBE = """
import psutil, torch
from diloco_async.learner.main import main
rc = main(['--learner-id', 'l0', '--index', '0', '--sync-url', 'http://127.0.0.1:9', '--store', 'memory://x'])

rss = lambda: psutil.Process().memory_info().rss

def step():  # six 4 MiB buffers made and freed, as a ~50M model's activations and AdamW temporaries
    bufs = [torch.ones(1 << 20) for _ in range(6)]
    del bufs

before = rss()
step()
kept = rss() - before
bufs = [torch.ones(1 << 20) for _ in range(6)]  # a step in flight: the heap's free memory in use
before = rss()
big = torch.ones(48 << 18)  # 48 MiB: one fragment of a 50M model, as downloaded or encoded
held = rss()
del big
print(rc, kept >> 20, (held - before) >> 20, (held - rss()) >> 20)
"""


def _probe() -> tuple[int, int, int, int]:
    env = {k: v for k, v in os.environ.items() if k != LEARNER_TOKEN_ENV}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    fields = out.stdout.split()
    assert len(fields) == 4, out.stderr[-2000:]
    return tuple(int(x) for x in fields)  # type: ignore[return-value]


def test_a_learner_keeps_its_step_buffers_mapped_and_gives_fragment_sized_ones_back():
    """Under the old settings (4 MiB mmap threshold, glibc's fixed 128 KiB trim threshold) the 24 MiB
    a step frees at its end went back to the system and was faulted in again at the next step; now
    it stays mapped for the next step. A 48 MiB buffer made while a step's memory is in use (a
    download or an encoded outer gradient) still leaves the process's RSS when it is freed, which a
    64 MiB mmap threshold with a 256 MiB trim threshold would not do."""
    rc, kept_mib, held_mib, released_mib = _probe()
    assert rc == 2  # refused to start (no token), after setting the interpreter up
    assert kept_mib >= 20, f"{kept_mib} MiB of a step's 24 MiB kept mapped"
    assert held_mib >= 44 and released_mib >= 44, (held_mib, released_mib)
