"""scripts/check_pins.py, which the container images run, run here against this environment: it
passes and names each difference from a changed pin file (the images' other checks without a
builder are tests/unit/test_container.py's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_container import ROOT  # noqa: F401, F811 (shared with unit/test_container.py; fixtures among them)


def _check_pins(constraints: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_pins.py"), str(constraints)],
                          capture_output=True, text=True, timeout=120)


def test_check_pins_passes_here_and_names_each_difference(tmp_path):
    """The test environment is installed from the same pins, so the image's check holds for it."""
    assert _check_pins(ROOT / "constraints.txt").returncode == 0
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    changed = [re.sub(r"^numpy==.*", "numpy==1.0.0", line) for line in lines if not line.startswith("psutil==")]
    (tmp_path / "c.txt").write_text("\n".join([*changed, "not-a-real-dist==1.0"]) + "\n")
    proc = _check_pins(tmp_path / "c.txt")
    assert proc.returncode == 1
    assert "numpy: 2." in proc.stderr and "1.0.0 pinned" in proc.stderr, proc.stderr
    assert "psutil:" in proc.stderr and "not pinned" in proc.stderr, proc.stderr
    assert "not-a-real-dist: pinned 1.0, not installed" in proc.stderr, proc.stderr
