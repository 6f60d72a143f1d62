"""How a command of the CLI runs a flow and what Ctrl-C and SIGTERM do meanwhile.

:func:`run_flow` runs a flow entry point inside Prefect's temporary server with the signal
handlers of :func:`on_interrupt`: the first signal stops a training run cleanly (the synchronizer
gets SIGINT and writes its final checkpoint) or, with ``STOP["at_once"]`` (chaos and WAN
comparisons, where a run cut short measures nothing) or before a synchronizer runs, stops at once;
a second signal stops every child now. Exit codes: the entry's, or 128 + the first signal.
"""

from __future__ import annotations

import sys

import psutil

__all__ = ["run_flow", "STOP", "INTERRUPTS", "exit_now"]


def prepare_environment() -> None:
    """Make Ctrl-C and SIGTERM a clean stop of the run (:func:`on_interrupt`)."""
    import os
    import signal

    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    signal.signal(signal.SIGTERM, on_interrupt)
    signal.signal(signal.SIGINT, on_interrupt)


INTERRUPTS: list[int] = []  # the signals received, in order
STOP = {"at_once": False}  # chaos: a comparison cut short measures nothing; the first signal stops it


def children() -> list[tuple[int, str]]:
    """(pid, command line joined by spaces) of this process's direct children (psutil). A zombie
    child is listed with an empty command line (its process group may outlive it); one that is
    gone by the time it is read is left out."""
    out = []
    for child in psutil.Process().children():
        try:
            out.append((child.pid, " ".join(child.cmdline())))
        except psutil.ZombieProcess:
            out.append((child.pid, ""))
        except psutil.Error:
            continue
    return out


def on_interrupt(signum, _frame) -> None:
    """First Ctrl-C or SIGTERM: stop the run cleanly. While a synchronizer runs it gets SIGINT (it
    writes its final checkpoint and tells the learners to stop; the flow then prints the summary
    and ends Completed); before one runs, after it exited, or in ``chaos``, the command stops at
    once (KeyboardInterrupt; the flow stops what it started). Second signal: stop every process
    now."""
    import os
    import signal

    INTERRUPTS.append(signum)
    if len(INTERRUPTS) > 1:
        stop_children_and_exit(exit_code())
    syncs = [pid for pid, cmd in children() if "diloco_async.server" in cmd]
    if not syncs or STOP["at_once"]:
        raise KeyboardInterrupt
    print(f"\n{signal.Signals(signum).name}: stopping the run cleanly (final checkpoint); "
          "Ctrl-C again to stop at once", file=sys.stderr, flush=True)
    for pid in syncs:
        os.kill(pid, signal.SIGINT)  # the synchronizer's clean stop; its stop reason names SIGINT


def exit_code() -> int:
    """128 + the first signal received (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + INTERRUPTS[0]


def stop_children_and_exit(code: int) -> None:
    """Stop every child (the flow's processes, Prefect's temporary server) and exit at once."""
    import os
    import signal

    for pid, _cmd in children():
        try:
            os.killpg(pid, signal.SIGTERM)  # each child leads its own process group
        except OSError:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
    print("interrupted: stopped at once", file=sys.stderr, flush=True)
    os._exit(code)


def run_flow(entry, *args, **kwargs) -> int:
    """Run a flow entry point with the embedded defaults and the Ctrl-C behaviour. Prefect's
    temporary server (when no ``PREFECT_API_URL`` is set) is this command's own, in its own
    session: a Ctrl-C does not kill it, and it stops after the flow run's final state was sent."""
    import os
    from pathlib import Path

    prepare_environment()
    try:
        from diloco_async.flows.prefect_server import temporary_server

        with temporary_server(Path(os.environ["PREFECT_HOME"]) / "temporary-server.log"):
            code = entry(*args, **kwargs)
    except KeyboardInterrupt:
        code = 0
    if INTERRUPTS:
        import signal

        if code <= 128:  # else the flow finished after the stop and said where its final checkpoint is
            print(f"interrupted ({signal.Signals(INTERRUPTS[0]).name}): stopped", file=sys.stderr, flush=True)
        exit_now(exit_code())
    if code > 128:  # stopped by a signal the flow itself took (SIGTERM while training)
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Exit after a stop without the interpreter's teardown of every imported module (torch,
    MLflow, Prefect: seconds on a loaded machine): the exit handlers run and the output is flushed
    first; everything the run started has already stopped."""
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
