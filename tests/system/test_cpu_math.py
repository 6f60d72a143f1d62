"""``learners.flush_denormal``: :func:`diloco_async.runtime.devices.set_cpu_math` flushes subnormal floats to
zero in the calling thread and in the intra-op threads started after it, or keeps them."""

import json
import platform
import subprocess
import sys

import pytest

# a fresh process: the flush mode is per thread, and pytest's own process may already run intra-op threads
SCRIPT = """
import json, sys, torch
from diloco_async.runtime.devices import set_cpu_math
torch.set_num_threads(1)  # as a learner starts
x = torch.full((1 << 22,), 1e-39)  # subnormal in float32 (smallest normal: 1.18e-38)
before = int((x * 1.0 == 0).sum())
flushed = set_cpu_math(2, sys.argv[1] == "on")
after = int((x * 1.0 == 0).sum())  # 4M elements: split over both intra-op threads
print(json.dumps({"flushed": flushed, "threads": torch.get_num_threads(), "before": before, "after": after,
                  "n": x.numel()}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="FTZ and DAZ are x86 modes")
def test_flushes_subnormals_in_every_intra_op_thread():
    r = _run("on")
    assert r["flushed"] and r["threads"] == 2 and r["before"] == 0
    assert r["after"] == r["n"], f"{r['n'] - r['after']} of {r['n']} subnormal products kept"


def test_keeps_subnormals_when_asked():
    r = _run("off")
    assert r == {"flushed": False, "threads": 2, "before": 0, "after": 0, "n": 1 << 22}
