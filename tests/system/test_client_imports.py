"""The synchronizer client imports neither torch nor the learner, checked in a fresh process (the
client's routes, headers, errors and timeouts are tests/contract/test_client.py's)."""

from __future__ import annotations

import json
import sys


def test_the_client_imports_neither_torch_nor_the_learner():
    import subprocess

    code = ("import json, sys, diloco_async.protocol.client; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'diloco_async.learner')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
