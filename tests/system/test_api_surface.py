"""``diloco_async.train`` / ``resume`` are the API's functions themselves, loaded on first access
(issue 46 item 1): a user's ``help(diloco_async.train)`` shows the real signature and docstring,
and ``import diloco_async`` alone imports neither the API nor torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest


def test_import_stays_light_and_the_names_are_the_apis_own():
    code = ("import sys, inspect, diloco_async\n"
            "light = not {'torch', 'diloco_async.api'} & set(sys.modules)\n"
            "from diloco_async import api, train, resume\n"
            "print(light, train is api.train, resume is api.resume, list(inspect.signature(train).parameters))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split(" ", 3)[:3] == ["True", "True", "True"], out.stdout
    assert "'config', 'overrides', 'on_status', 'poll_s'" in out.stdout


def test_the_api_docstring_is_shown_and_unknown_names_still_fail():
    import diloco_async

    assert "summary" in inspect.getdoc(diloco_async.train)
    assert "checkpoint_url" in str(inspect.signature(diloco_async.resume))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        diloco_async.__getattr__("nope")
