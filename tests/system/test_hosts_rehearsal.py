"""The multi-host rehearsal (issue 46 item 6, docs/multi-host.md): ``python -m diloco_async.flows.rehearsal``,
what ``make rehearse-hosts`` runs, end to end on real namespaces, Prefect, MLflow and S3 (moto);
and :mod:`diloco_async.wan.hostns`, the way each host's worker is started. Needs root, ``ip``,
``tc`` and ``nsenter`` (CI runs as root); otherwise those tests skip with the refusal's reason.
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

from diloco_async.flows import rehearsal
from diloco_async.wan.netns import LinkSpec, WanNet, cleanup
from diloco_async.wan.netns_core import list_netns

ROOT = Path(__file__).resolve().parents[2]
REASON = rehearsal.refusal()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"multi-host rehearsal unavailable: {REASON}")


def unique_prefix() -> str:
    return "dlr" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3))


def mounts_under(folder: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return [line.split()[4] for line in fh if line.split()[4].startswith(str(folder))]


def pids_with_env(needle: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and needle.encode() in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_the_rehearsal_refuses_without_root_naming_why(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in rehearsal.refusal() and "euid is 1000" in rehearsal.refusal()
    assert rehearsal.main(["--folder", "/nonexistent/never-made"]) == 2
    assert "rehearse-hosts refused: the multi-host rehearsal needs root" in capsys.readouterr().err
    assert not Path("/nonexistent/never-made").exists()


def test_the_rehearsal_refuses_a_folder_in_use(tmp_path, capsys):
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        rehearsal.main(["--folder", str(tmp_path)])
    assert exit_.value.code == 2 and f"--folder {str(tmp_path)!r} is not empty" in capsys.readouterr().err


def test_hostns_refuses_a_call_without_a_program():
    done = subprocess.run([sys.executable, "-m", "diloco_async.wan.hostns", "some-ns", "--cwd", "/"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "no program: give it after --" in done.stderr


@needs_root
def test_hostns_hides_the_other_folders_and_enters_the_network_namespace(tmp_path):
    """A program started through hostns sees the hidden folder empty and read-only, runs in its
    own folder and in the region's network namespace; its mounts never reach this namespace."""
    own, other = tmp_path / "own", tmp_path / "other"
    own.mkdir()
    other.mkdir()
    (other / "secret.txt").write_text("of another host")
    code = f"""
import json, os
def can(fn):
    try:
        fn()
        return True
    except OSError:
        return False
print(json.dumps({{"entries": os.listdir({str(other)!r}), "cwd": os.getcwd(),
                  "net": os.stat("/proc/self/ns/net").st_ino,
                  "read": can(lambda: open({str(other / 'secret.txt')!r}, "rb").read()),
                  "wrote": can(lambda: open({str(other / 'x')!r}, "w").write("x"))}}))
"""
    with WanNet([LinkSpec("r0", 100, 100)], prefix=unique_prefix(), verify=False) as net:
        ns = net.ns_of("r0")
        done = subprocess.run([sys.executable, "-m", "diloco_async.wan.hostns", ns, "--hide", str(other), "--cwd",
                               str(own), "--", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["net"] == os.stat(f"/var/run/netns/{ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
    assert seen["entries"] == [] and seen["read"] is False and seen["wrote"] is False
    assert seen["cwd"] == str(own)
    assert (other / "secret.txt").read_text() == "of another host"  # here the folder is as it was
    assert mounts_under(tmp_path) == []


@needs_root
@pytest.mark.timeout(1800)
def test_train_on_two_hosts_then_resume_on_the_other_host(tmp_path):
    """``make rehearse-hosts``: train deploys a learner to each host through the regional
    deployments and finishes; resume from the S3 checkpoint runs on host-b with each learner on the
    other host; no host can see another's folder; every recorded path opens from the other hosts;
    nothing is left afterwards."""
    prefix = unique_prefix()
    folder = tmp_path / "rehearsal"
    with open(tmp_path / "driver.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "diloco_async.flows.rehearsal", "--folder", str(folder),
                                 "--prefix", prefix],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=1700)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cleanup(prefix)
    out = (tmp_path / "driver.log").read_text(errors="replace")
    result = json.loads((folder / "result.json").read_text())
    failed = [v for v in result["verdicts"] if not v["ok"]]
    assert code == 0 and not failed, f"{failed}\n{out[-6000:]}"
    assert len(result["verdicts"]) == 10, result["verdicts"]  # 3 hosts sealed, 2 runs, swap, placement, 2 x paths, left
    # where each flow run ran: train on the synchronizer's host, its learners on host-a then host-b;
    # resume on host-b, its learners swapped
    assert [x["pool"] for x in result["train"]] == ["hosts-sync", "region-a", "region-b"]
    assert [x["pool"] for x in result["resume"]] == ["region-b", "region-b", "region-a"]
    assert [x["learner_id"] for x in result["resume"][1:]] == ["learner-0", "learner-1"]
    # the processes sampled during the run: on every machine, each in its own namespaces
    by_host = {}
    for p in result["processes"]:
        by_host.setdefault(p["host"], set()).add((p["mnt"], p["net"]))
    for host in ("host-a", "host-b", "sync"):
        assert by_host[host] == {tuple(result["isolation"][host]["worker_ns"])}, by_host
    assert len({next(iter(by_host[h])) for h in ("host-a", "host-b", "sync")}) == 3
    # what was opened from each learner host: the store's checkpoint objects, the MLflow artifacts, the model
    for host in ("host-a", "host-b"):
        resolved = result["paths"][host]["resolved"]
        assert result["paths"][host]["checkpoint_seq"] is not None
        assert any("/checkpoints/" in x["value"] for x in resolved)
        assert any(x["where"].startswith("model diloco-rehearsal/") for x in resolved)
        assert any(" artifact " in x["where"] and x["value"].startswith("s3://") for x in resolved)
    assert [ns for ns in list_netns() if ns.startswith(prefix)] == []
    assert mounts_under(folder) == []
    assert pids_with_env(f"DILOCO_REHEARSAL={result['marker']}") == []
