"""A URL the product prints is never followed by punctuation: a terminal and the Prefect UI link
the text up to the next space, so ``synchronizer at http://127.0.0.1:43957; starting`` linked
``http://127.0.0.1:43957;`` (issue 46). Every message template of the product code is read with
``ast``: an f-string, or a ``%``-format string with its arguments (logging calls, ``%`` formatting),
whose placeholder holds a URL (by its expression's name: ``url``, ``uri``, ``endpoint``, ``webhook``)
must be followed by a space, a line end or the end of the string. A URL quoted with ``!r`` is
delimited by its quotes and is not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("diloco_async",)  # storage and flows are subpackages
URL_NAME = re.compile(r"(url|uri|endpoint|webhook)\b|_url\(|url\(", re.I)
SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdifrxXeEgGc%]")
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def _is_url(expr: ast.AST) -> bool:
    return bool(URL_NAME.search(ast.unparse(expr)))


def _trailing_punctuation(after: str) -> str | None:
    """The punctuation that ends the word a URL starts (``after``: the text that follows the URL's
    placeholder, other placeholders as ``X``), or None when the word ends with a letter, a digit or
    ``/``, or there is no word (a space or the end follows the URL)."""
    word = re.split(r"\s", after, maxsplit=1)[0]
    return word[-1] if word and not (word[-1].isalnum() or word[-1] == "/") else None


def _fstring_faults(node: ast.JoinedStr) -> list[str]:
    """Each URL placeholder of an f-string whose word ends with punctuation: ``{url};`` and
    ``{store_url}/{key})`` do, ``{url}/status`` and ``{url} (reason)`` do not."""
    faults, parts = [], node.values
    for i, part in enumerate(parts):
        if isinstance(part, ast.FormattedValue) and part.conversion != ord("r") and _is_url(part.value):
            after = "".join("X" if isinstance(p, ast.FormattedValue) else str(p.value) for p in parts[i + 1:])
            if bad := _trailing_punctuation(after):
                faults.append(f"{{{ast.unparse(part.value)}}}...{bad}")
    return faults


def _percent_faults(fmt: str, args: list[ast.AST]) -> list[str]:
    faults = []
    specs = [m for m in SPEC.finditer(fmt) if m.group() != "%%"]
    for m, arg in zip(specs, args, strict=False):
        after = SPEC.sub("X", fmt[m.end():])
        if m.group().endswith("s") and _is_url(arg) and (bad := _trailing_punctuation(after)):
            faults.append(f"{ast.unparse(arg)} -> %s{bad}")
    return faults


def template_faults(source: str) -> list[str]:
    """``line: placeholder + punctuation`` for every URL placeholder of ``source`` followed by
    punctuation (see the module docstring)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            out += [f"{node.lineno}: {f}" for f in _fstring_faults(node)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out += [f"{node.lineno}: {f}" for f in _percent_faults(node.args[0].value, node.args[1:])]
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant)
              and isinstance(node.left.value, str)):
            args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            out += [f"{node.lineno}: {f}" for f in _percent_faults(node.left.value, args)]
    return out


@pytest.mark.parametrize("source, faults", [
    ('log.info("synchronizer at %s; starting %d learners", url, n)', 1),
    ('log.info("synchronizer %s, store %s", sync_url, store_url)', 1),
    ('print(f"done ({done.id}) at {args.webhook} [server {api_url()}]")', 1),
    ('raise ValueError(f"no run in {store.url} (looked for {store.url}/{key})")', 1),
    ('print(f"{url}: answered no JSON")', 1),
    ('print(f"MLflow run: {run_url}.")', 1),
    ('log.info("synchronizer listening on %s", url)', 0),
    ('log.info("starting %d learners; synchronizer at %s", n, url)', 0),
    ('print(f"continue with: diloco-async resume {store_url}/{run_id}")', 0),
    ('print(f"no answer from {url}/status ({err})")', 0),
    ('raise ValueError(f"bad URL {url!r}: no scheme")', 0),
    ('print(f"{name}: {count} runs")', 0),
])
def test_the_check_finds_a_url_followed_by_punctuation(source, faults):
    assert len(template_faults(source)) == faults, template_faults(source)


def test_no_printed_url_is_followed_by_punctuation():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{f}" for f in template_faults(path.read_text())]
    assert not found, "URLs followed by punctuation (put the URL last, or a space after it):\n" + "\n".join(found)
