"""The docs site's strict build (mkdocs.yml, `make docs`): it passes on the repository's pages with
the generated ones in place, and a broken anchor fails it. Real `mkdocs build` processes; a few
seconds each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300, check=False)


def test_the_site_builds_strictly_with_its_generated_pages(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    reference = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "learners.batch_size" in reference and "model.lora.target_modules" in reference
    assert "diloco_async.sync" in (tmp_path / "site" / "reference" / "modules" / "index.html").read_text()
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="config/#check-a-recipe-before-running-it-validate"' in home  # README's links, rebased
    assert (tmp_path / "site" / "figures" / "index.html").exists()


def test_a_broken_anchor_or_link_fails_the_build(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "docs", src / "docs")
    (src / "scripts").mkdir()
    for name in ("mkdocs.yml", "README.md", "scripts/docs_hooks.py", "scripts/docs_reference.py"):
        shutil.copy(ROOT / name, src / name)
    page = src / "docs" / "simulator.md"
    page.write_text(page.read_text() + "\n[a](storage.md#no-such-heading) [b](no-such-page.md)\n")
    done = build(src, tmp_path / "site")
    assert done.returncode != 0
    assert "does not contain an anchor '#no-such-heading'" in done.stderr
    assert "'no-such-page.md', but the target is not found" in done.stderr
