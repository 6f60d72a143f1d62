"""The unit tier: a test here that starts a process, binds or connects a socket, or sleeps for real
(in a thread or on the event loop, longer than :data:`tier_guard.MAX_SLEEP_S`) fails, where it did
it and again at teardown (so one swallowed by a library or done in a background thread still fails)."""

from __future__ import annotations

import platform

import pytest
import tier_guard
import urllib3.util.connection  # noqa: F401

tier_guard.install()  # before the tests import anything: a module's own reference to the sleep is the watched one

# Probes some libraries make once, on import, before any watch starts: they are not what a test does.
platform.processor()  # cached by the platform module; MLflow asks on import, the first ask runs `uname -p`
# urllib3.util.connection binds a socket to [::1] on import to learn whether IPv6 works (imported above)


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built():
    """Builds the C kernels (a compiler process) once, before the guard watches: on a machine whose
    cache is empty the first unit test that quantizes or merges would otherwise start the compiler.
    A machine without a compiler keeps the torch code, as in production."""
    from diloco_async.codec import native as codec_native
    from diloco_async.kernels import build

    for source in (build.SOURCE, codec_native.SOURCE):
        try:
            build.build(source)
        except (OSError, RuntimeError):  # BuildError included: no compiler, a failed build
            pass
    yield


@pytest.fixture(autouse=True)
def _unit_tier_guard():
    with tier_guard.watch(enforce=True) as seen:
        yield
    if seen.seen:
        pytest.fail("a unit test did what only tests/contract/ or tests/system/ may:\n"
                    + "\n".join(f"  {kind}: {detail}, at\n{where}" for (kind, detail), where in
                                zip(seen.seen, seen.where, strict=True)), pytrace=False)
