"""The README and the pages under docs/ hold together: every relative link reaches a file (and a
heading, for an anchor into a markdown file), the README stays a five-minute read, and every
`make` target and `diloco-async` subcommand it names exists. A page the docs site generates as it
builds (scripts/docs_reference.py ``GENERATED_PAGES``: docs/reference/config.md, ...) counts as a file,
with the headings of its generated text. Pure file reading: no network, no process."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from diloco_async.flows.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is not a package
from docs_reference import GENERATED_PAGES  # noqa: E402

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links and headings there are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _code(text: str) -> str:
    """Only the code of the text: fenced blocks and inline code spans, one per line."""
    fenced = [m.group(0) for m in _FENCE.finditer(text)]
    inline = [m.group(0).strip("`") for m in _INLINE_CODE.finditer(_FENCE.sub("", text))]
    return "\n".join(fenced + inline)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped (hyphens, underscores and spaces
    kept), lowercase, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def generated(path: Path) -> str | None:
    """The text of the page the docs site generates at ``path`` (under docs/), else None."""
    make = GENERATED_PAGES.get(path.relative_to(DOCS).as_posix()) if path.is_relative_to(DOCS) else None
    return None if make is None else make()


def anchors(page: Path) -> set[str]:
    """Every anchor of a markdown page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    text = page.read_text() if page.exists() else generated(page) or ""
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        slug = github_slug(match.group(1))
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not _EXTERNAL.match(t)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file does not exist, or whose #anchor into a markdown
    file names no heading there, each as 'page: target (why)', paths relative to ``root``."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        name = f"{page.relative_to(root)}: {target}"
        if not dest.exists() and generated(dest) is None:
            broken.append(f"{name} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{name} (no heading with that anchor in {dest.relative_to(root)})")
    return broken


def makefile_targets() -> set[str]:
    """The explicit targets of the Makefile's rules (not variables, patterns or `define` bodies)."""
    text = re.sub(r"^define .*?^endef$", "", (ROOT / "Makefile").read_text(), flags=re.M | re.S)
    targets = set()
    for match in re.finditer(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)[ \t]*:(?!=)", text, re.M):
        targets.update(t for t in match.group(1).split() if not t.startswith("."))
    return targets


def cli_subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_slugs_follow_githubs_rules():
    assert github_slug("Check a recipe before running it: `validate`") == "check-a-recipe-before-running-it-validate"
    assert github_slug("1. Overview") == "1-overview"
    assert github_slug("Does it reproduce the paper? `diloco-async ablate`, `make bench-paper`") == (
        "does-it-reproduce-the-paper-diloco-async-ablate-make-bench-paper")
    assert github_slug("make_bench: Δ on the GPU") == "make_bench-δ-on-the-gpu"


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    root = tmp_path.resolve()
    (root / "other.md").write_text("# Other\n\n## A part\n\n## A part\n")
    page = root / "page.md"
    page.write_text("# Page\n[ok](other.md#a-part-1) [self](#page) [web](https://example.com/x) [dir](.)\n"
                    "[gone](missing.md) [no heading](other.md#nowhere) `[in code](nowhere.md)`\n"
                    "```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(page, root) == ["page.md: missing.md (no such file)",
                                        "page.md: other.md#nowhere (no heading with that anchor in other.md)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert not broken_links(page), "broken links:\n" + "\n".join(broken_links(page))


def test_readme_is_a_five_minute_read():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move a topic to docs/"


def test_every_make_target_the_readme_names_exists():
    named = set(re.findall(r"(?<![\w/.-])make[ \t]+([a-z][\w-]*)", _code(README.read_text())))
    assert named, "the README names no make target"
    assert named <= makefile_targets(), f"not targets of the Makefile: {sorted(named - makefile_targets())}"


def test_every_cli_subcommand_the_readme_names_exists():
    named = set(re.findall(r"diloco-async[ \t]+([a-z][\w-]*)", _code(README.read_text())))
    assert named, "the README names no diloco-async subcommand"
    assert named <= cli_subcommands(), f"not subcommands of diloco-async: {sorted(named - cli_subcommands())}"
