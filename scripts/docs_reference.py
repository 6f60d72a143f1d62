"""The generated pages of the docs site (docs/testing.md "The docs site"): written at build time by
the mkdocs hook (scripts/docs_hooks.py), never committed, so they cannot go stale.

* :func:`config_reference` — every field of the recipe's pydantic tree, walked from
  :class:`diloco_async.config.schema.Config`: dotted name, type (with its bounds), default, description;
* :func:`module_map` — every package of ``diloco_async/`` (``diloco_async/storage/`` and
  ``diloco_async/flows/`` among them) with the first paragraph of its docstring and its modules'
  first lines (read with :mod:`ast`, nothing imported);
* :func:`figures_page` — the "Current figures" table from ``docs/figures.json``, the results file
  ``make bench`` writes through :func:`benchmarks.bars.print_bars`.

Each returns the page's markdown as a ``str``; :data:`GENERATED_PAGES` maps the page's path under
docs/ to its generator. Plain functions, so unit tests call them without mkdocs.
"""

from __future__ import annotations

import ast
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["ConfigField", "config_fields", "config_reference", "packages", "module_map", "figures_page",
           "GENERATED_PAGES", "ROOT", "MAPPED_ROOTS", "FIGURES_FILE"]

ROOT = Path(__file__).resolve().parents[1]
#: The top-level packages the module map covers (storage and flows are subpackages of diloco_async).
MAPPED_ROOTS = ("diloco_async",)
#: The committed results file `make bench` refreshes (benchmarks/bars.py), read by :func:`figures_page`.
FIGURES_FILE = ROOT / "docs" / "figures.json"

_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤",
           "pattern": "matches"}


@dataclass(frozen=True)
class ConfigField:
    """One field of the config tree: ``name`` dotted from the root (``learners.batch_size``), its
    ``section`` (the dotted name of the model that holds it; ``""`` for :class:`Config` itself)."""

    name: str
    section: str
    model: type[BaseModel]
    info: FieldInfo


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (``LoraSettings | None`` -> [LoraSettings])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def config_fields(model: type[BaseModel], prefix: str = "") -> Iterator[ConfigField]:
    """Every field of ``model`` and, depth first, of every model a field's type names, in
    declaration order (a section's own row comes before its fields)."""
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        yield ConfigField(dotted, prefix.rstrip("."), model, info)
        for sub in _models_in(info.annotation):
            yield from config_fields(sub, f"{dotted}.")


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> list[str]:
    out = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return out


def _toml(value: Any) -> str:
    """A default as a recipe would write it (TOML); None is 'unset'."""
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):  # a section's default instance: the fields it sets beyond their defaults
        changed = {k: getattr(value, k) for k in sorted(value.model_fields_set)}
        return ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in changed.items()) or "its fields' defaults"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    """Text as one table cell: pipes escaped outside code spans (inside them a table keeps them whole)."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _default(info: FieldInfo) -> str:
    return "required" if info.is_required() else _toml(info.get_default(call_default_factory=True))


def _row(field: ConfigField) -> str:
    ann = field.info.annotation
    kind = f"`{_type_name(ann)}`" + "".join(f", {b}" for b in _bounds(field.info))
    subs = _models_in(ann)
    meaning = field.info.description or ""
    if subs:
        meaning = (meaning + " " if meaning else "") + f"The fields: [{field.name}](#{_anchor(field.name)})."
        meaning += "" if not subs[0].__doc__ else f" {_rst_to_markdown(_first_paragraph(subs[0].__doc__))}"
    meaning = _cell(meaning).replace("<", "&lt;") or "–"  # 'bpe:<vocab size>' is text, not an HTML tag
    return f"| `{field.name}` | {_cell(kind)} | {_cell(_default(field.info))} | {meaning} |"


def _anchor(section: str) -> str:
    return section.replace(".", "")


def config_reference() -> str:
    """The config reference page: a table per section of the tree, in the order of :class:`Config`."""
    from diloco_async.config.schema import Config

    head = ["# Config reference", "",
            "Generated from the pydantic models of `diloco_async/config/` (and the learner device fields of",
            "`diloco_async/runtime/devices.py`) when the site is built: every field a recipe may set, with its",
            "type and bounds, its default and its description. How recipes and `--set` work:",
            "[Recipes, `validate` and the config reference](../config.md). A default is the field's when its",
            "section is written in the recipe; a section left out of a recipe takes the default in the first table.",
            ""]
    sections: dict[str, list[ConfigField]] = {}
    for field in config_fields(Config):
        sections.setdefault(field.section, []).append(field)
    lines = head
    for section, fields in sections.items():
        title = section or "Sections"
        lines += [f"## {title}", ""]
        doc = fields[0].model.__doc__
        if section and doc:
            lines += [_rst_to_markdown(_first_paragraph(doc)), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        lines += [_row(f) for f in fields] + [""]
    return "\n".join(lines)


def _first_paragraph(doc: str) -> str:
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())


def _rst_to_markdown(text: str) -> str:
    """Sphinx roles and double backticks as markdown code: ``:mod:`~a.b.c``` -> ```c```, ````x```` -> ```x```."""
    text = re.sub(r":[a-z]+:`~([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def packages(roots: tuple[str, ...] = MAPPED_ROOTS, root: Path = ROOT) -> list[str]:
    """Dotted names of every package (a folder with ``__init__.py``) under ``roots``, sorted."""
    return sorted(".".join(p.parent.relative_to(root).parts) for r in roots for p in (root / r).rglob("__init__.py"))


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""


def module_map(roots: tuple[str, ...] = MAPPED_ROOTS, root: Path = ROOT) -> str:
    """The module map page: per package, its docstring's first paragraph, then each module's first line."""
    lines = ["# Module map", "",
             "Generated from the package and module docstrings of " + ", ".join(f"`{r}/`" for r in roots)
             + " when the site is built. Which layer may import which: [Architecture](../architecture.md).", ""]
    for name in packages(roots, root):
        folder = root.joinpath(*name.split("."))
        summary = _first_paragraph(_docstring(folder / "__init__.py")) or "(no package docstring)"
        lines += [f"## {name}", "", _rst_to_markdown(summary), ""]
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                first = _docstring(module).strip().split("\n\n")[0].splitlines()
                line = _rst_to_markdown(" ".join(s.strip() for s in first)) if first else "–"
                lines.append(f"- `{module.stem}`: {line}")
        lines.append("")
    return "\n".join(lines)


def figures_page(path: Path = FIGURES_FILE) -> str:
    """The "Current figures" page: the newest value of every bar ``make bench`` printed, per benchmark
    table, with its goal, result, commit and date (``path``: the results file; absent or empty: none yet)."""
    results = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
    lines = ["# Current figures", "",
             "The newest value of every bar a `make bench` run printed (benchmarks/bars.py `print_bars` merges",
             "its rows into `docs/figures.json`; commit that file to publish them here). Each row says the",
             "commit and the date (UTC) it was measured at; the measurement logs are under [Log](log/index.md).",
             ""]
    if not results:
        return "\n".join(lines + ["No figures yet: no `make bench` run has written `docs/figures.json`.", ""])
    for table, rows in sorted(results.items()):
        lines += [f"## {table}", "", "| figure | value | goal | result | commit | measured | detail |",
                  "|---|---:|---|---|---|---|---|"]
        for figure, r in sorted(rows.items()):
            value = "n/a" if r.get("value") is None else f"{r['value']:.4g}"
            goal = f"{'≥' if r.get('kind', 'min') == 'min' else '≤'} {r['goal']:g}"
            lines.append(f"| {_cell(figure)} | {value} | {goal} | {r['result']} | `{r['commit']}` | {r['date']} | "
                         f"{_cell(r.get('detail', ''))} |")
        lines.append("")
    return "\n".join(lines)


#: Path under docs/ -> generator of the page's markdown.
GENERATED_PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_reference,
    "reference/modules.md": module_map,
    "figures.md": figures_page,
}


def main(argv: list[str] | None = None) -> int:
    """``python scripts/docs_reference.py PAGE``: print a generated page (PAGE: a key of GENERATED_PAGES)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in GENERATED_PAGES:
        print(f"usage: docs_reference.py {{{','.join(GENERATED_PAGES)}}}", file=sys.stderr)
        return 2
    print(GENERATED_PAGES[args[0]]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
