"""One real run of the default recipe (synchronizer + learners as OS processes on loopback, a
file:// store) with the given overrides, then its bytes on the wire per token (up, down) and the
held-out loss of the final model: the synchronizer's master value and the published value the
learners adopt (they differ with compressed downloads). Also DDP's ring all-reduce bytes per
token per worker for the same model and the ratio (issue 13 item 3).

Usage: python scripts/download_codec_run.py NAME [--set key=value ...] > NAME.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from diloco_async.config.resolved import with_fields, write_resolved
from diloco_async.config.schema import load_config
from diloco_async.metrics.evaluation import heldout_batches, heldout_loss, model_from_checkpoint
from diloco_async.metrics.heldout_monitor import load_versions
from diloco_async.models import build_run_model, trainable_parameters
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.storage.store import ObjectStore

TOKEN = "download-codec-run-secret-0123456789abcdef"
RECIPE = "configs/default.toml"


def ddp_bytes_per_token(params: int, workers: int, tokens_per_step: int) -> float:
    """Bytes one worker sends per token in a ring all-reduce of fp32 gradients:
    2·(N−1)/N · 4 · params per step, over the tokens of one worker's step."""
    return 2 * (workers - 1) / workers * 4 * params / tokens_per_step


def run(name: str, overrides: list[str], timeout_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"dlc-{name}-"))
    store_url = f"file://{tmp}/store"
    cfg = with_fields(load_config(RECIPE, overrides), {"run.store": store_url, "run.workdir": f"{tmp}/runs"})
    launcher = LocalProcessLauncher(tmp / "logs")
    t0 = time.monotonic()
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", "--resolved-config",
                                           str(write_resolved(cfg, tmp)), "--run-id", name,
                                           "--ready-file", str(tmp / "ready.json")], {TOKEN_ENV: TOKEN})
    learners = []
    try:
        url = wait_for_ready_file(tmp / "ready.json", sync, timeout_s=120)["url"]
        for i in range(cfg.learners.count):
            lid = f"learner-{i}"
            learners.append(launcher.start(lid, ["-m", "diloco_async.learner", "--learner-id", lid, "--index", str(i),
                                                 "--sync-url", url, "--store", store_url],
                                           {LEARNER_TOKEN_ENV: learner_token(TOKEN, name, lid)}))
        code = sync.proc.wait(timeout=timeout_s)
        for p in learners:
            p.proc.wait(timeout=60)
    finally:
        for p in [*learners, sync]:
            p.terminate(grace_s=5)
    wall_s = time.monotonic() - t0
    store = ObjectStore(store_url)
    epoch = json.loads((tmp / "ready.json").read_text())["epoch"]
    summary = store.get_json(keys.summary_key(name, epoch))
    ckpt = latest_checkpoint(store, name)
    batches = heldout_batches(cfg)
    master = heldout_loss(model_from_checkpoint(cfg, ckpt), batches)
    model = build_run_model(cfg)
    plan = FragmentPlan.from_json(store.get_json(keys.plan_key(name))["plan"])
    load_versions(model, store, name, plan, {int(p): int(v) for p, v in ckpt.manifest["versions"].items()})
    published = heldout_loss(model, batches)
    params = sum(t.numel() for t in trainable_parameters(model).values())
    ddp = ddp_bytes_per_token(params, cfg.learners.count, cfg.learners.batch_size_of(0) * cfg.model.context)
    up, down = summary["bytes_up_per_token"], summary["bytes_down_per_token"]
    return {"name": name, "overrides": overrides, "exit_code": code, "wall_s": round(wall_s, 1),
            "tokens_processed": summary["tokens_processed"], "merges": summary["merges"],
            "bytes_up_per_token": up, "bytes_down_per_token": down, "bytes_total_per_token": up + down,
            "ddp_bytes_per_token_per_worker": ddp, "ratio_vs_ddp": ddp / (up + down), "params": params,
            "eval_loss_master": master, "eval_loss_published": published,
            "bytes_by_fragment": summary["bytes_by_fragment"], "logs": str(tmp / "logs")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--timeout-s", type=float, default=1500.0)
    a = ap.parse_args(argv)
    json.dump(run(a.name, a.overrides, a.timeout_s), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
