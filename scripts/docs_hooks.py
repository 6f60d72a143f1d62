"""The mkdocs hooks of the docs site (``hooks:`` in mkdocs.yml; ``make docs`` builds it, docs/testing.md).

* :func:`on_config` — headings get GitHub's anchors (:func:`github_slug`), so one ``page.md#anchor``
  works both on GitHub and on the site; the Log section of the nav lists every ``docs/log/*.md``;
* :func:`on_files` — the generated pages of :mod:`docs_reference` (config reference, module map,
  current figures), the home page (README.md, its links rebased onto docs/) and the log's index;
* :func:`on_page_markdown` — a link that leaves docs/ (``../diloco_async/flows/cli.py``) keeps working on GitHub
  in the source, and on the site becomes a link into ``repo_url`` when mkdocs.yml sets one, else the
  file's path from the repository root as code.

Nothing is written into docs/: the generated pages exist only in the built site.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

# scripts/ is not a package: mkdocs puts this file's folder on sys.path while it loads the hook (tests do too)
from docs_reference import GENERATED_PAGES
from mkdocs.structure.files import File

__all__ = ["github_slug", "rebase_readme", "site_links", "log_index", "on_config", "on_files",
           "on_page_markdown"]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"(!?\[((?:[^\[\]]|\[[^\]]*\])*)\])\(\s*<?([^)\s>]+)>?((?:\s+\"[^\"]*\")?)\s*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
LOG_TITLE = "Log"


def github_slug(text: str, separator: str = "-") -> str:
    """GitHub's anchor of a heading's text: punctuation dropped (hyphens, underscores, spaces kept),
    lowercase, each space one ``separator`` (runs are not collapsed, as on GitHub)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", separator)


def _mask(text: str) -> tuple[str, Callable[[str], str]]:
    """``text`` with its fenced blocks and inline code replaced by placeholders, and the function that
    puts them back (a link whose text holds code still matches a link pattern on the masked text)."""
    held: list[str] = []

    def hold(m: re.Match[str]) -> str:
        held.append(m.group(0))
        return f"\x00{len(held) - 1}\x00"
    masked = _INLINE_CODE.sub(hold, _FENCE.sub(hold, text))
    return masked, lambda t: re.sub("\x00(\\d+)\x00", lambda m: held[int(m.group(1))], t)


def _map_links(text: str, fn: Callable[[str, str], str | None]) -> str:
    """Each relative link's target ``t`` of the prose replaced by ``fn(t, link_text)``: a new target,
    or None to keep the link, or a string starting with ``=`` that replaces the whole link."""
    masked, restore = _mask(text)

    def one(m: re.Match[str]) -> str:
        label, inner, target, title = m.group(1), m.group(2), m.group(3), m.group(4)
        if _EXTERNAL.match(target) or target.startswith("#"):
            return m.group(0)
        new = fn(target, restore(inner))
        if new is None:
            return m.group(0)
        return new[1:] if new.startswith("=") else f"{label}({new}{title})"
    return restore(_LINK.sub(one, masked))


def rebase_readme(readme: str, root: Path = ROOT, docs: Path = DOCS) -> str:
    """README.md's text as the site's home page (docs/index.md): each relative link made relative to
    ``docs`` (``docs/x.md`` -> ``x.md``); a link to a folder under docs/ goes to its ``index.md``."""
    def rebase(target: str, _text: str) -> str:
        path, sep, anchor = target.partition("#")
        dest = (root / path).resolve()
        new = os.path.relpath(dest, docs).replace(os.sep, "/")
        if dest.is_dir() and dest.is_relative_to(docs):
            new = f"{new}/index.md"
        return new + sep + anchor
    return _map_links(readme, rebase)


def site_links(markdown: str, page_uri: str, repo_url: str | None, root: Path = ROOT, docs: Path = DOCS) -> str:
    """The page's markdown for the site: each link that leaves ``docs`` (the page is ``docs/page_uri``)
    goes into ``repo_url`` (``/blob/main/``, ``/tree/main/`` for a folder), or without one becomes
    the file's path from ``root`` as code (after the link's text when that text is not the path)."""
    def fn(target: str, text: str) -> str | None:
        path, sep, anchor = target.partition("#")
        dest = Path(os.path.normpath(docs / Path(page_uri).parent / path))
        if dest.is_relative_to(docs) or not dest.is_relative_to(root):
            return None
        rel = dest.relative_to(root).as_posix()
        if repo_url:
            return f"{repo_url.rstrip('/')}/{'tree' if dest.is_dir() else 'blob'}/main/{rel}{sep}{anchor}"
        return f"=`{rel}`" if text.strip("`") in (rel, dest.name) else f"={text} (`{rel}`)"
    return _map_links(markdown, fn)


def log_index(docs: Path = DOCS) -> str:
    """The log's index page: every dated log of docs/log/, newest first, with its first paragraph."""
    lines = [f"# {LOG_TITLE}", "", "Dated measurement logs (UTC), newest first: what was measured, how, on which",
             "machine and commit.", ""]
    for page in sorted((docs / "log").glob("*.md"), reverse=True):
        paragraphs = [p for p in page.read_text().split("\n\n") if p.strip() and not p.startswith("#")]
        first = " ".join(paragraphs[0].split()) if paragraphs else ""
        lines.append(f"- [{page.stem}]({page.name}): {first}")
    return "\n".join(lines + [""])


def on_config(config, **_):
    """GitHub's heading anchors; the nav's Log section: its index, then every dated log, newest first."""
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    logs = [f"log/{p.name}" for p in sorted((Path(config.docs_dir) / "log").glob("*.md"), reverse=True)]
    for entry in config.nav or []:
        if isinstance(entry, dict) and LOG_TITLE in entry:
            entry[LOG_TITLE] = ["log/index.md", *logs]
    return config


def on_files(files, config, **_):
    """Add the generated pages (never written into docs/)."""
    pages = {uri: make for uri, make in GENERATED_PAGES.items()}
    pages["index.md"] = lambda: rebase_readme((ROOT / "README.md").read_text())
    pages["log/index.md"] = log_index
    for uri, make in pages.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def on_page_markdown(markdown, page, config, **_):
    """Links that leave docs/: into ``repo_url``, or the repository path as code."""
    return site_links(markdown, page.file.src_uri, config.repo_url)
