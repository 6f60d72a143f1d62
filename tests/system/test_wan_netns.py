"""The WAN harness on real kernel links: network namespaces, veth pairs shaped with tc tbf, a timed
TCP transfer per direction, a tiny Decoupled DiLoCo run across a shaped link, and teardown (also
after the harness is SIGKILLed). Needs root, ``ip`` and ``tc`` (CI runs as root); otherwise the
tests that need them skip with :func:`~diloco_async.wan.netns.root_reason`'s message.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_async.runtime.procs import LocalProcessLauncher
from diloco_async.wan.launch import NetnsLauncher
from diloco_async.wan.netns import LinkRateError, LinkSpec, WanNet, cleanup, root_reason
from diloco_async.wan.netns_core import list_links, list_netns, run_cmd
from diloco_async.wan.probe import timed_transfer

from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
REASON = root_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"WAN harness unavailable: {REASON}")


def unique_prefix() -> str:
    """A prefix no other test on this machine uses: ``dlt`` + 3 random characters (WanNet adds a
    random tag of its own); cleanup with it touches nothing else."""
    return "dlt" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3))


def leftovers(prefix: str) -> list[str]:
    """Namespaces, interfaces and qdiscs on this machine whose names start with ``prefix``."""
    found = [f"netns {ns}" for ns in list_netns() if ns.startswith(prefix)]
    found += [f"link {name}" for name in list_links(None) if name.startswith(prefix)]
    qdiscs = json.loads(run_cmd(["tc", "-j", "qdisc", "show"]) or "[]")
    found += [f"qdisc on {q['dev']}" for q in qdiscs if str(q.get("dev", "")).startswith(prefix)]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def start_tiny_run(tmp_path: Path, prefix: str, tokens: int = 40_000) -> subprocess.Popen:
    """tests/wan_tiny_run.py as a child in its own session, its output in ``driver.log``."""
    argv = [sys.executable, str(ROOT / "tests" / "wan_tiny_run.py"), "--prefix", prefix,
            "--workdir", str(tmp_path / "work"), "--tokens", str(tokens)]
    with open(tmp_path / "driver.log", "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True)


def driver_log(tmp_path: Path) -> str:
    return (tmp_path / "driver.log").read_text(errors="replace")[-4000:]


# -- without root ---------------------------------------------------------------------------------

def test_link_specs_and_prefixes_are_checked():
    with pytest.raises(ValueError, match="region"):
        LinkSpec("Region_0", 1, 1)
    with pytest.raises(ValueError, match="up_mbit"):
        LinkSpec("r0", 0, 1)
    with pytest.raises(ValueError, match="down_mbit"):
        LinkSpec("r0", 1, float("nan"))
    with pytest.raises(ValueError, match="15 characters"):
        WanNet([LinkSpec("r0", 1, 1)], prefix="muchtoolong")
    with pytest.raises(ValueError, match="repeat"):
        WanNet([LinkSpec("r0", 1, 1), LinkSpec("r0", 2, 2)])
    for short in ("", "e", "lo", "Eth", "dlw_"):  # a host interface (eth0, lo) can never match
        with pytest.raises(ValueError, match="cleanup prefix"):
            cleanup(short)


def test_root_reason_names_what_is_missing(monkeypatch, tmp_path):
    """Without root, or without iproute2 on PATH, the harness says why (what the tests skip with)."""
    probe = root_reason.__wrapped__  # uncached
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in probe() and "euid is 1000" in probe()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "needs `ip`" in probe()


# -- with root ------------------------------------------------------------------------------------

@needs_root
def test_tiny_run_across_a_shaped_link_merges_and_leaves_nothing(tmp_path):
    prefix = unique_prefix()
    proc = start_tiny_run(tmp_path, prefix)
    try:
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cleanup(prefix)
    assert code == 0, driver_log(tmp_path)
    result = json.loads((tmp_path / "work" / "result.json").read_text())
    fig = result["verified"]["r0"]
    for way in ("up", "down"):
        assert fig[f"{way}_mbit_set"] == 4.0
        assert abs(fig[f"{way}_error"]) <= 0.15, fig
    # the synchronizer advertised the hub's address, and the run merged to its token budget
    assert result["sync_url"].startswith(f"http://{result['hub_addr']}:"), result["sync_url"]
    summary = result["summary"]
    assert result["sync_exit"] == 0 and summary["stop_reason"].startswith("token budget"), summary["stop_reason"]
    assert summary["merges"] > 0 and summary["contributions_merged"] > 0
    # the run's bytes crossed the shaped veth both ways: at least what the synchronizer counted
    run_bytes = result["link_bytes"]["r0"]
    assert run_bytes["up_bytes"] >= summary["bytes_in"] > 0, (run_bytes, summary["bytes_in"])
    assert run_bytes["down_bytes"] >= summary["bytes_out"] > 0, (run_bytes, summary["bytes_out"])
    assert leftovers(prefix) == []
    assert not [name for name, pid in result["pids"].items() if alive(pid)]


@needs_root
def test_a_killed_harness_leaves_nothing_after_cleanup(tmp_path):
    prefix = unique_prefix()
    proc = start_tiny_run(tmp_path, prefix, tokens=50_000_000)  # still training when it is killed
    progress = tmp_path / "work" / "progress.json"
    try:
        def merging() -> bool:
            assert proc.poll() is None, driver_log(tmp_path)
            return progress.exists() and json.loads(progress.read_text())["stage"] == "merging"

        wait_until(merging, 300, "the tiny run to merge")
        os.kill(proc.pid, signal.SIGKILL)  # the harness alone: its run keeps going inside the namespaces
        proc.wait(timeout=10)
        state = json.loads(progress.read_text())
        assert len([x for x in leftovers(prefix) if x.startswith("netns")]) == 2  # hub + r0 outlived it
        assert all(alive(pid) for pid in state["pids"].values()), state["pids"]
        removed = cleanup(prefix)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cleanup(prefix)
    assert {f"netns {state['name']}-hub", f"netns {state['name']}-r0"} <= set(removed), removed
    assert any(item.startswith("link ") for item in removed), removed
    assert sum(item.startswith("process ") for item in removed) >= 3, removed  # synchronizer, learner, moto
    assert leftovers(prefix) == []
    wait_until(lambda: not any(alive(pid) for pid in state["pids"].values()), 10, "the run's processes to go")


@needs_root
def test_the_context_manager_tears_down_on_an_exception(tmp_path):
    """A process started in a region by NetnsLauncher over LocalProcessLauncher runs inside that
    namespace; an exception in the ``with`` body still removes the namespaces, veths and qdiscs,
    and the process."""
    prefix = unique_prefix()
    code = "import os, time; print(os.stat('/proc/self/ns/net').st_ino, flush=True); time.sleep(120)"
    with pytest.raises(RuntimeError, match="boom"):
        with WanNet([LinkSpec("r0", 8, 8)], prefix=prefix, verify=False) as net:
            region_ns = net.ns_of("r0")
            launcher = NetnsLauncher(LocalProcessLauncher(tmp_path / "logs"), lambda name: region_ns)
            handle = launcher.start("sleeper", ["-c", code], {})
            wait_until(lambda: handle.log_path.read_text().strip() != "", 30, "the sleeper to start")
            assert int(handle.log_path.read_text().split()[0]) == os.stat(f"/var/run/netns/{region_ns}").st_ino
            assert int(handle.log_path.read_text().split()[0]) != os.stat("/proc/self/ns/net").st_ino
            assert len(leftovers(prefix)) == 2
            raise RuntimeError("boom")
    assert leftovers(prefix) == []
    assert handle.wait(timeout=10) == -signal.SIGKILL


@needs_root
def test_a_link_measured_against_a_wrong_rate_refuses_to_start():
    """Shaped to 4 Mbit/s up, checked against 8: LinkRateError names the direction and figures;
    the down link, checked against its own setting, passes."""
    prefix = unique_prefix()
    with WanNet([LinkSpec("r0", 4, 4)], prefix=prefix, verify=False) as net:
        with pytest.raises(LinkRateError, match=r"r0 up: set 8\.000 Mbit/s") as err:
            net.verify([LinkSpec("r0", up_mbit=8, down_mbit=4)])
        assert "r0 down" not in str(err.value)
        fig = net.verified["r0"]
        assert fig["up_error"] == pytest.approx(-0.5, abs=0.1)  # about half the expected rate
        assert abs(fig["down_error"]) <= 0.15
    assert leftovers(prefix) == []


@needs_root
def test_regions_reach_each_other_through_the_hub_across_both_links():
    prefix = unique_prefix()
    with WanNet([LinkSpec("r0", 40, 40), LinkSpec("r1", 40, 40)], prefix=prefix, verify=False) as net:
        before = net.link_counters()
        r0, r1 = net.regions["r0"], net.regions["r1"]
        for rn in (r0, r1):  # one interface name in every region (one GLOO_SOCKET_IFNAME for all ranks)
            assert rn.region_veth == net.region_ifname and net.region_ifname in list_links(rn.ns)
        done = timed_transfer(r1.ns, r1.addr, r0.ns, total_bytes=400_000, skip_bytes=100_000, timeout_s=20)
        after = net.link_counters()
        assert done.received_bytes == 400_000 and not done.timed_out
        assert after["r0"]["up_bytes"] - before["r0"]["up_bytes"] >= 400_000  # out of r0, into the hub
        assert after["r1"]["down_bytes"] - before["r1"]["down_bytes"] >= 400_000  # out of the hub, into r1
        assert after["r0"]["down_bytes"] - before["r0"]["down_bytes"] < 100_000  # only acknowledgements back
    assert leftovers(prefix) == []


@needs_root
def test_the_cleanup_command_removes_a_net_that_was_never_closed():
    prefix = unique_prefix()
    net = WanNet([LinkSpec("r0", 8, 8)], prefix=prefix, verify=False)
    net.create()  # no context manager: as if the process had died
    assert len(leftovers(prefix)) == 2
    done = subprocess.run([sys.executable, "-m", "diloco_async.wan.cleanup", "--prefix", prefix], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"removed netns {net.hub_ns}" in done.stdout and f"removed netns {net.ns_of('r0')}" in done.stdout
    assert leftovers(prefix) == []
