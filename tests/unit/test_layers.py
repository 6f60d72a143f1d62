"""Layers, read from the source by import-linter (pyproject.toml [tool.importlinter]): every import of
the library (``diloco_async/`` but its deployment layer, ``diloco_async/storage/`` included), lazy and
type-only ones too, names none of the deployment layer (``diloco_async/flows/``), Prefect, MLflow,
matplotlib or rich (STYLE: "The library never imports Prefect or MLflow"); no package has an import
cycle; and the house's size limits. Each module imported alone in a fresh process:
tests/system/test_layers_imports.py.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_PACKAGES = ("diloco_async",)
#: the deployment layer: a subpackage of the distribution, not of the library
DEPLOYMENT_LAYER = "diloco_async.flows"
FORBIDDEN = (DEPLOYMENT_LAYER, "prefect", "mlflow", "matplotlib", "rich")


def _is_deployment(name: str) -> bool:
    return name == DEPLOYMENT_LAYER or name.startswith(DEPLOYMENT_LAYER + ".")


def library_modules() -> list[str]:
    """Dotted names of every module and package under :data:`LIBRARY_PACKAGES` but the deployment
    layer, from the files on disk (the deployment layer is not imported to find them; a library
    package is, as :func:`pkgutil.walk_packages` does to find its subpackages)."""
    names: list[str] = []
    for package in LIBRARY_PACKAGES:
        names.append(package)
        for info in pkgutil.iter_modules([str(ROOT / package)], prefix=f"{package}."):
            if _is_deployment(info.name):
                continue
            names.append(info.name)
            if info.ispkg:
                where = str(ROOT.joinpath(*info.name.split(".")))
                names += [sub.name for sub in pkgutil.walk_packages([where], prefix=f"{info.name}.")]
    return sorted(names)


def test_the_walk_finds_the_packages_and_their_subpackages_but_not_the_deployment_layer():
    names = library_modules()
    assert {"diloco_async", "diloco_async.storage", "diloco_async.config.schema", "diloco_async.storage.keys"} <= set(
        names)
    assert any(n.startswith("diloco_async.sim.") for n in names)  # a subpackage is walked into
    assert not [n for n in names if _is_deployment(n)]


def test_the_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts, checked in this process (``make test`` also
    runs ``lint-imports``): the library (every import, lazy ones and type-only ones included) names
    none of the deployment layer, Prefect, MLflow, matplotlib or rich; storage imports nothing of
    training; no package has an import cycle among its modules and subpackages; the library's
    packages keep their layers (docs/architecture.md); a package's internals are imported only by
    the modules each contract names."""
    import tomllib

    from importlinter import configuration
    from importlinter.application import use_cases

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = {c["name"]: c for c in contracts if c["type"] == "forbidden"}
    library = next(c for c in forbidden.values() if DEPLOYMENT_LAYER in c["forbidden_modules"]
                   and c.get("as_packages", True))
    assert set(FORBIDDEN) <= set(library["forbidden_modules"])
    # its sources are every package and module of diloco_async but flows/: a new one must be added
    assert set(library["source_modules"]) == {n for n in library_modules() if n.count(".") == 1}
    own = next(c for c in forbidden.values() if c["source_modules"] == ["diloco_async"])
    assert own.get("as_packages") is False and set(FORBIDDEN) <= set(own["forbidden_modules"])
    assert any(c["type"] == "acyclic_siblings" for c in contracts)
    assert any(c["type"] == "layers" and c["containers"] == ["diloco_async"] and c["exhaustive"] for c in contracts)
    assert {"diloco_async.sync.*", "diloco_async.learner.*", "diloco_async.merge.*", "diloco_async.storage.reader"} <= {
        m for c in contracts if c["type"] == "protected" for m in c["protected_modules"]}
    configuration.configure()  # not importlinter.cli.lint_imports: it re-configures logging and so disables every
    # logger that exists (later tests in this worker would then capture no log record)
    assert use_cases.lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True)


# Size limits (STYLE 12): a module owns one idea, a function does one thing. Tests are exempt.
SIZED_PACKAGES = ("diloco_async", "benchmarks", "scripts")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def sized_sources() -> list[Path]:
    return sorted(p for package in SIZED_PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_over_the_size_limit():
    over = [f"{p.relative_to(ROOT)}: {n} lines" for p in sized_sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)


def test_no_function_over_the_size_limit():
    over = []
    for path in sized_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)
