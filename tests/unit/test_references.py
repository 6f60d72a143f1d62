"""Every dotted name of the project's code that the code, the tests, the docs and the config files
mention (``diloco_async.sync.summary.status``, ``diloco_async.storage.keys``, ``diloco_async.flows.cli``)
resolves: after a module moves, a docstring, a page or a ``python -m`` line that still names the old place fails
here. The dated logs (docs/log/) are history and keep the names of their day."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![\w/.-])((?:diloco_async|storage|flows)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _names_defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Top-level names of a module or class body: defs, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # if TYPE_CHECKING:, try: ... except ImportError:
            out.update(_names_defined(node.body))
    return out


@cache
def resolves(name: str) -> bool:
    """``name`` is a module of the tree, or a module and a name it defines (one level into a
    class), read from the source: nothing is imported (the unit tier starts no process, and
    importing Prefect does)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(parts[:i])
        if path is None:
            continue
        rest = parts[i:]
        if not rest or rest[0].startswith("__"):  # the module itself, or one of its dunders
            return True
        defined = _names_defined(ast.parse(path.read_text()).body)
        node = defined.get(rest[0])
        if node is None:
            return False
        if len(rest) > 1 and isinstance(node, ast.ClassDef):
            return rest[1] in _names_defined(node.body)
        return True
    return False


FOLDERS = ("diloco_async", "benchmarks", "scripts", "tests", "docs", "configs", "examples")
FILES = ("README.md", "pyproject.toml", "Makefile", "mkdocs.yml", "prefect.yaml")


def mentioned_names() -> dict[str, list[str]]:
    """name -> the files (relative) that mention it."""
    paths = [ROOT / f for f in FILES if (ROOT / f).exists()]
    paths += [p for d in FOLDERS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".toml", ".yml")
              and "__pycache__" not in p.parts and not p.is_relative_to(ROOT / "docs" / "log")]
    out: dict[str, list[str]] = {}
    for path in paths:
        for m in NAME.finditer(path.read_text(errors="replace")):
            out.setdefault(m.group(1).rstrip("."), []).append(str(path.relative_to(ROOT)))
    return out


def test_every_dotted_name_the_tree_mentions_resolves():
    names = mentioned_names()
    # the walk finds them
    assert {"diloco_async.sync.summary", "diloco_async.storage.keys", "diloco_async.flows.cli"} <= set(names)
    wrong = {n: sorted(set(fs))[:3] for n, fs in names.items() if not resolves(n)
             and n not in ALLOWED}
    assert not wrong, "names that no longer resolve (moved or renamed?):\n" + "\n".join(
        f"  {n}  in {', '.join(fs)}" for n, fs in sorted(wrong.items()))


#: prose that only looks like a dotted name
ALLOWED = {"flows.split", "storage.md"}
