"""Layers: the library (``diloco_async/``, its storage layer ``diloco_async/storage/`` included) never
imports the deployment layer (``diloco_async/flows/``), Prefect, MLflow, matplotlib or rich (STYLE: "The
library never imports Prefect or MLflow").

Every module of the library, found by walking the packages on disk (a new module is checked
without being listed here), is imported on its own in a fresh process; the test fails naming the
module and what it pulled in. The fresh processes are forks of one new interpreter that has
imported no module of this project, only a few allowed third-party packages (torch, numpy, ...),
so that each import costs milliseconds instead of seconds of torch start-up; that interpreter
checks first that none of the forbidden packages is loaded. A second test reads every import
statement of the library, those inside functions too (a lazy import is still an import).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_layers import FORBIDDEN, LIBRARY_PACKAGES, ROOT, library_modules  # noqa: F401, F811 (shared with unit/test_layers.py; fixtures among them)

#: Allowed third-party packages the probe imports once before forking (speed only).
PRELOAD = ("torch", "numpy", "pydantic", "fsspec", "aiohttp", "safetensors")


# Runs in a new interpreter: argv = forbidden, preload, modules (comma-separated). Prints one JSON
# object: module -> {"loaded": [forbidden packages in sys.modules]} or {"error": "..."}. A forbidden
# name is a package with every module under it (diloco_async.flows is one, diloco_async is not).
_PROBE = r"""
import importlib, json, os, sys

forbidden, preload, modules = (arg.split(",") for arg in sys.argv[1:4])


def loaded():
    return sorted(f for f in forbidden if any(n == f or n.startswith(f + ".") for n in sys.modules))


for name in preload:
    importlib.import_module(name)
already = loaded()
if already:
    sys.exit(f"the preloaded packages import {already}")
results = {}
for module in modules:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            out = {"loaded": loaded()}
        except BaseException as err:
            out = {"error": f"{type(err).__name__}: {err}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    results[module] = json.loads(b"".join(chunks) or b'{"error": "no answer"}')
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, dict]:
    """module -> what importing it alone loaded (see :data:`_PROBE`)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, ",".join(FORBIDDEN), ",".join(PRELOAD),
                          ",".join(library_modules())], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", library_modules())
def test_library_module_imports_no_deployment_layer(module: str, imported: dict[str, dict]):
    got = imported[module]
    assert "error" not in got, f"importing {module} alone failed: {got.get('error')}"
    assert not got["loaded"], (f"{module} imports {', '.join(got['loaded'])}; the library must not "
                               "(STYLE: the library never imports diloco_async.flows, Prefect, MLflow, matplotlib "
                               "or rich)")
