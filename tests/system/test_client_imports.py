"""The synchronizer client against a small stand-in server on loopback: routes, headers, errors, timeouts."""

from __future__ import annotations

import json
import sys


def test_the_client_imports_neither_torch_nor_the_learner():
    import subprocess

    code = ("import json, sys, diloco_async.client; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'diloco_async.learner')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
