"""``diloco-async recipes``: every shipped recipe with its description and what it needs before it
runs (:func:`diloco_async.prerequisites.prerequisites`), then the chaos, WAN and ablation scenario
files with the command that runs each."""

from __future__ import annotations

import argparse
import shutil
import textwrap

__all__ = ["print_recipes"]

_INDENT = " " * 21



def _paragraphs(paragraphs: list[str], width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in paragraphs or ["(no description)"]:
        if paragraph.startswith(" "):  # a command example: as it is
            lines.append(_INDENT + "  " + paragraph.strip())
        else:
            lines.extend(textwrap.wrap(paragraph, width, initial_indent=_INDENT, subsequent_indent=_INDENT,
                                       break_on_hyphens=False))
    return lines


def _needs(name: str, width: int) -> list[str]:
    """One wrapped line per prerequisite of recipe ``name`` (or why it could not be read)."""
    from diloco_async.validate import recipe_prerequisites

    try:
        found = recipe_prerequisites(name)
    except (ValueError, FileNotFoundError) as err:
        return [f"{_INDENT}needs: (the recipe does not load here: {err})"]
    lines = []
    for p in found:
        state = "present" if p.present else ("missing" if p.present is False else "made on first use")
        lines.extend(textwrap.wrap(f"needs {p.what} {p.where} ({state}): {p.how}", width, initial_indent=_INDENT,
                                   subsequent_indent=_INDENT + "  ", break_on_hyphens=False))
    return lines


def print_recipes(_args: argparse.Namespace) -> int:
    """Every shipped recipe: its name, its leading comment block wrapped to the terminal and its
    prerequisites; then the scenario files of chaos, WAN and ablation runs."""
    from diloco_async.validate import SCENARIO_COMMANDS, list_recipes, list_scenarios

    width = max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    for i, (name, paragraphs) in enumerate(list_recipes()):
        lines = ([""] if i else []) + _paragraphs(paragraphs, width) + _needs(name, width)
        first = 1 if i else 0
        lines[first] = f"{name:<20} " + lines[first][len(_INDENT):]
        print("\n".join(lines))
    scenarios = list_scenarios()
    for kind, command in SCENARIO_COMMANDS.items():
        files = [(path, paragraphs) for k, path, paragraphs in scenarios if k == kind]
        print(f"\n{kind} scenario files (run one with `{command} FILE`):")
        for path, paragraphs in files:
            summary = textwrap.shorten(paragraphs[0], width - 4, placeholder=" ...") if paragraphs else ""
            print(f"  {path}\n      {summary}")
    return 0
