"""Compressed downloads in a real run (issue 13 item 3): a synchronizer and two learner processes
on loopback over a file:// store, ``download_codec = "int4"`` as deltas; one learner joins late.

What each learner adopted (the base copies in its saved inner state) equals, bit for bit, the
published value the synchronizer anchors on for that version (the fp32 object it reads back as
``history[v]``, and its checkpoint's ``published`` tensors for the current version); the learners
got the versions mostly as int4 deltas (bytes down far below fp32's); /status and the metric
stream carry bytes per token up and down, per learner and per fragment, and the link figures.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from resolved_config import resolved_args
from test_integration import TOKEN, learner_env, tiny_recipe

from diloco_async.protocol.client import TOKEN_ENV, call_blocking, fetch_status
from diloco_async.protocol.versions import read_version
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint, latest_state, tensor_key
from diloco_async.storage.store import ObjectRef, ObjectStore, sha256_hex

from polling import wait_until


def _start_learner(launcher, tmp_path: Path, url: str, i: int):
    return launcher.start(f"learner-{i}", ["-m", "diloco_async.learner", "--learner-id", f"learner-{i}", "--index",
                                           str(i), "--sync-url", url, "--store", f"file://{tmp_path}/store"],
                          learner_env("dtest", f"learner-{i}"))


def _rendered(status: dict) -> str:
    from rich.console import Console  # the status view (flows/); the library stays free of rich

    from diloco_async.flows.status_view import render_status
    console = Console(record=True, width=300)
    console.print(render_status(status))
    return console.export_text()


def _ref(store: ObjectStore, key: str) -> ObjectRef:
    data = store.get_unverified(key)
    return ObjectRef(key, len(data), sha256_hex(data))


def _merged(url: str, lid: str) -> int:
    return fetch_status(url)["learners"].get(lid, {}).get("contributions", {}).get("merged", 0)


def _all_metrics(url: str) -> list[dict]:
    """Every metric point so far: ``/metrics`` answers one page at a time."""
    points: list[dict] = []
    while True:
        body = call_blocking(url, TOKEN, "metrics", len(points))
        points.extend(body["metrics"])
        if not body["metrics"] or len(points) >= body["total"]:
            return points


def _run(tmp_path: Path) -> tuple[dict, list]:
    recipe = tiny_recipe(tmp_path, learners=2, wall_s=300)
    text = recipe.read_text().replace("batch_size = 8", "batch_size = 8\ncheckpoint_every_s = 0.5")
    recipe.write_text(text.replace("checkpoint_every_s = 2.0", "checkpoint_every_s = 2.0\nkeep_checkpoints = 0\n"
                                   "download_codec = \"int4\"\ndownload_mode = \"delta\""))
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "dtest", "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    procs = []
    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        procs.append(_start_learner(launcher, tmp_path, url, 0))
        wait_until(lambda: fetch_status(url)["merges"] >= 6, 90, "six merges with one learner")
        procs.append(_start_learner(launcher, tmp_path, url, 1))  # joins late: versions 2+ exist
        wait_until(lambda: _merged(url, "learner-1") >= 6, 120, "the late learner's merged contributions")
        status = fetch_status(url)
        metrics = _all_metrics(url)
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=90) == 0
        for p in procs:
            assert p.proc.wait(timeout=30) == 0
    finally:
        for p in procs + [sync]:
            p.terminate(grace_s=5)
    return status, metrics


def test_learners_adopt_the_value_the_synchronizer_anchors_on(tmp_path):
    status, metrics = _run(tmp_path)
    store = ObjectStore(f"file://{tmp_path}/store")
    plan = store.get_json(keys.plan_key("dtest"))["plan"]
    shapes = {p: {s["name"]: tuple(s["shape"]) for s in frag} for p, frag in enumerate(plan["fragments"])}
    checked = 0
    for lid in ("learner-0", "learner-1"):
        saved = latest_state(store, keys.learner_prefix("dtest", lid))
        assert saved is not None, lid
        for p, v in saved.manifest["inner"]["base_versions"].items():
            published = read_version(store, _ref(store, keys.version_key("dtest", int(p), v)), shapes[int(p)])
            for n, t in published.items():
                assert torch.equal(saved.tensors[f"base/{p}/{n}"], t), f"{lid} fragment {p} v{v} {n}"
            checked += v > 0
    assert checked >= 2  # versions rebuilt from deltas, not only version 0
    ckpt = latest_checkpoint(store, "dtest")
    for p, v in ckpt.manifest["versions"].items():  # the synchronizer's current anchor is that object
        published = read_version(store, _ref(store, keys.version_key("dtest", int(p), v)), shapes[int(p)])
        assert all(torch.equal(ckpt.tensors[tensor_key(int(p), "published", n)], t) for n, t in published.items())
    # bytes: int4 deltas, far below fp32 downloads of the same versions
    fp32_nbytes = {p: sum(4 * torch.Size(s).numel() for s in sh.values()) for p, sh in shapes.items()}
    versions = {int(p): int(v) for p, v in ckpt.manifest["versions"].items()}
    for p, figures in status["bytes_by_fragment"].items():
        assert figures["bytes_down"] < 0.5 * 2 * versions[int(p)] * fp32_nbytes[int(p)], (p, figures)
        assert figures["bytes_up"] > 0 and figures["bytes_up_per_token"] > 0
    assert 0 < status["bytes_down_per_token"] < status["bytes_up_per_token"] * 2
    for lid in ("learner-0", "learner-1"):
        lf = status["learners"][lid]
        assert lf["bytes_down"] > 0 and lf["bytes_up_per_token"] > 0 and lf["link_budget_s"] > 0
        assert isinstance(lf["link_bound"], bool) and lf["link_s_per_fragment"] > 0
    text = _rendered(status)
    assert "B/token up / down" in text and "link" in text
    keys_seen = {m["key"] for m in metrics}
    for key in ("net/bytes_up_per_token", "net/bytes_down_per_token", "net/learner/learner-1/bytes_down_per_token",
                "net/fragment/0/bytes_up_per_token", "learner/learner-0/link_s_per_fragment"):
        assert key in keys_seen, key
