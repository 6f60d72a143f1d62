"""The docs site's generated pages (scripts/docs_reference.py) and hooks (scripts/docs_hooks.py):
the config reference has a row for every field of every config model, the module map a section for
every package, the figures page shows what the results file holds, and the links of the site point
where the files do. The models and the packages are walked here on their own (``model_fields``,
pyproject.toml's package list), not with the generator's walk. No process: `make docs` (and
`make test`) run the strict build itself."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is not a package
import docs_hooks  # noqa: E402
import docs_reference  # noqa: E402

from diloco_async.config.schema import Config  # noqa: E402


def dotted_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of ``model`` and of the models its fields hold (``X | None`` and lists included)."""
    names = []
    for name, info in model.model_fields.items():
        names.append(prefix + name)
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                names += dotted_fields(ann, f"{prefix}{name}.")
            stack += typing.get_args(ann)
    return names


def table_rows(page: str) -> dict[str, list[str]]:
    """The first cell (without backticks) -> the other cells, of every table row of a page."""
    rows = {}
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.findall(r"(?:`[^`]*`|\\\||[^|`])+", line)]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_config_reference_has_a_row_for_every_field_of_every_model():
    fields = dotted_fields(Config)
    assert {"run.store", "learners.device", "model.hf.pretrained", "model.lora.target_modules",
            "guard.round_timeout_s", "data.tokenizer"} <= set(fields)  # the walk reaches every section
    rows = table_rows(docs_reference.config_reference())
    missing = [f for f in fields if f not in rows]
    assert not missing, f"fields missing from the config reference: {missing}"
    assert len(rows) == len(fields), f"rows that are no field: {sorted(set(rows) - set(fields))}"


def test_every_leaf_field_of_the_config_says_what_it_is():
    """The reference is generated from the descriptions: a field without one is a hole in it."""
    def leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
        out = []
        for name, info in model.model_fields.items():
            sub = [a for a in (typing.get_args(info.annotation) or (info.annotation,))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
            out += leaves(sub[0], f"{prefix}{name}.") if sub else [(prefix + name, info.description)]
        return out

    bare = [name for name, description in leaves(Config) if not description]
    assert not bare, f"config fields without a description: {bare}"


def test_each_row_gives_the_fields_type_default_and_description():
    rows = table_rows(docs_reference.config_reference())
    kind, default, description = rows["learners.count"]
    assert (kind, default) == ("`int`, ≥ 1", "`4`")
    assert description == Config.model_fields["learners"].annotation.model_fields["count"].description
    assert rows["synchronizer.merge"][:2] == ['`"rda" | "mean"`', '`"rda"`']  # a code span keeps its pipes
    assert rows["model.lora.target_modules"][1] == "required"
    assert rows["model.lora"][1] == "unset" and "(#modellora)" in rows["model.lora"][2]
    assert rows["budget"][1] == "`tokens = 4000000`"  # Config's default section, not BudgetConfig's
    assert rows["budget.tokens"][1] == "unset"
    assert "&lt;vocab size>" in rows["data.tokenizer"][2]  # not an HTML tag


def test_the_module_map_has_a_section_for_every_package_with_its_docstring():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = [p for p in project["tool"]["setuptools"]["packages"] if p.split(".")[0] in docs_reference.MAPPED_ROOTS]
    assert {"diloco_async", "diloco_async.sync", "diloco_async.storage", "diloco_async.flows"} <= set(listed)
    page = docs_reference.module_map()
    headings = re.findall(r"^## (\S+)$", page, re.M)
    assert sorted(headings) == sorted(listed)
    for name in listed:
        doc = ast.get_docstring(ast.parse(ROOT.joinpath(*name.split("."), "__init__.py").read_text()))
        first_words = " ".join(doc.split()[:4]).replace("``", "`")
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert first_words.split(":mod:")[0] in section, name


def test_the_figures_page_shows_the_results_file_or_says_there_are_none(tmp_path):
    path = tmp_path / "figures.json"
    assert "No figures yet" in docs_reference.figures_page(path)
    path.write_text("{}\n")
    assert "No figures yet" in docs_reference.figures_page(path)
    path.write_text(json.dumps({"make bench: bars": {"merge speed-up | x": {
        "value": 2.345678, "goal": 2.0, "kind": "min", "result": "ok", "commit": "abc1234",
        "date": "2026-12-06", "detail": "3 repeats"}}}))
    page = docs_reference.figures_page(path)
    assert "## make bench: bars" in page
    assert "| merge speed-up \\| x | 2.346 | ≥ 2 | ok | `abc1234` | 2026-12-06 | 3 repeats |" in page


def test_the_figures_page_renders_what_the_bars_table_recorded(tmp_path):
    from benchmarks.bars import Bar, record_bars

    path = tmp_path / "figures.json"
    record_bars(path, "merge bars", [Bar("merge / torch", 2.5, 2.0, detail="median of 5"),
                                     Bar("peak RSS (GB)", None, 7.0, "max")], commit="abc1234", date="2026-12-06")
    rows = [line for line in docs_reference.figures_page(path).splitlines() if line.startswith("| ") and "`" in line]
    assert rows == ["| merge / torch | 2.5 | ≥ 2 | ok | `abc1234` | 2026-12-06 | median of 5 |",
                    "| peak RSS (GB) | n/a | ≤ 7 | MISS | `abc1234` | 2026-12-06 |  |"]


def test_the_site_uses_githubs_anchors():
    assert docs_hooks.github_slug("Check a recipe before running it: validate") == (
        "check-a-recipe-before-running-it-validate")
    assert docs_hooks.github_slug("make_bench: Δ on the GPU") == "make_bench-δ-on-the-gpu"
    assert docs_hooks.github_slug("a -- b") == "a----b"  # not collapsed, as on GitHub


def test_the_readme_becomes_the_home_page_with_its_links_rebased_onto_docs():
    readme = ("[a](docs/config.md#x) [log](docs/log/) [cli](flows/cli.py) [web](https://x.org/a.md) "
              "[top](#top) `[code](docs/a.md)`\n```\n[block](docs/b.md)\n```\n[`code` text](docs/wan.md)\n")
    assert docs_hooks.rebase_readme(readme) == (
        "[a](config.md#x) [log](log/index.md) [cli](../flows/cli.py) [web](https://x.org/a.md) "
        "[top](#top) `[code](docs/a.md)`\n```\n[block](docs/b.md)\n```\n[`code` text](wan.md)\n")


def test_a_link_that_leaves_docs_becomes_the_repository_path_or_a_link_into_the_repository():
    page = "[the CLI](../../flows/cli.py) [`flows/cli.py`](../../flows/cli.py#L1) [wan](../wan.md) `[x](../../a.py)`"
    assert docs_hooks.site_links(page, "log/2026-12-06.md", None) == (
        "the CLI (`flows/cli.py`) `flows/cli.py` [wan](../wan.md) `[x](../../a.py)`")
    assert docs_hooks.site_links(page, "log/2026-12-06.md", "https://github.com/o/r/") == (
        "[the CLI](https://github.com/o/r/blob/main/flows/cli.py) "
        "[`flows/cli.py`](https://github.com/o/r/blob/main/flows/cli.py#L1) [wan](../wan.md) `[x](../../a.py)`")


def test_the_log_index_lists_every_dated_log_newest_first():
    index = docs_hooks.log_index()
    logs = sorted((ROOT / "docs" / "log").glob("*.md"), reverse=True)
    assert re.findall(r"^- \[([^\]]+)\]", index, re.M) == [p.stem for p in logs]
