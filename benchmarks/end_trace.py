"""Diagnosis of the end of a run (issue 44, item 1; ``benchmarks.end_of_run --trace N``): the model
after each of the last N merges, rebuilt from the published versions and evaluated, with what each
merge closed.

Needs the versions of those merges in the store (the caller turns garbage collection off). Per
merge: seconds from the drain's start (negative: before it; read from the synchronizer's log line
``stopping (...): draining``), fragment, round, version, quorum, the contributions' inner steps,
tokens and staleness (versions published after their base), the norm of the published step
``‖Θ_v - Θ_{v-1}‖`` and the held-out loss of the whole model just after it (nats/token).

For the last merge of every fragment the final checkpoint's momentum ``b`` splits the last outer
step (Nesterov, DESIGN §4.5: ``Θ_v = Θ_{v-1} - η(g + λμb)``, λ = ``synchronizer.drain_lookahead``
for a drain's last round, 1 before issue 44's fix) into its gradient part ``η‖g‖`` and its
momentum part ``ημ‖b‖``, and two counterfactual final models are evaluated: without the last
merge of every fragment, and with it as a plain SGD step ``Θ_{v-1} - ηg``. The split assumes that
every fragment's last merge was a drain's last round (true unless a round was in flight when the
drain began).
"""

from __future__ import annotations

import datetime as dt
import json
import re

import torch

from diloco_async.codec import wire
from diloco_async.config.schema import Config
from diloco_async.data.tokens import HeldoutSplit
from diloco_async.metrics.evaluation import heldout_loss
from diloco_async.models import build_run_model, trainable_parameters
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint, tensor_key

__all__ = ["trace_last_merges", "drain_started_s"]

_DRAIN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) synchronizer INFO .*stopping \(.*\): draining")


def drain_started_s(log_text: str) -> float | None:
    """Unix seconds of the synchronizer's ``stopping (...): draining`` line (its local-time
    ``asctime``), or None when the run stopped without a drain."""
    for line in log_text.splitlines():
        m = _DRAIN.match(line)
        if m:
            return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def _version(store, run_id: str, plan: FragmentPlan, p: int, v: int) -> dict[str, torch.Tensor]:
    shapes = {s.name: s.shape for s in plan.fragments[p]}
    tensors, _meta = wire.decode_from_bytes(store.get_unverified(keys.version_key(run_id, p, v)), "fp32", shapes)
    return tensors


def _loss(cfg: Config, split: HeldoutSplit, values: dict[str, torch.Tensor]) -> float:
    model = build_run_model(cfg)
    params = trainable_parameters(model)
    with torch.no_grad():
        for name, t in values.items():
            params[name].copy_(t)
    return heldout_loss(model, split.batches)


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


def _last_steps(cfg: Config, store, run_id: str, plan: FragmentPlan, ckpt: Checkpoint,
                final: dict[int, int], split: HeldoutSplit) -> dict:
    """The last outer step of every fragment split into η‖g‖ and ημ‖b‖, and the counterfactual
    final models (without those steps; with them as plain SGD steps)."""
    eta, mu = cfg.synchronizer.outer_lr, cfg.synchronizer.outer_momentum
    lam = getattr(cfg.synchronizer, "drain_lookahead", 1.0)  # 1: the full Nesterov step (before the field)
    prev_all, sgd_all, final_all, parts = {}, {}, {}, {}
    for p, v in final.items():
        cur, prev = _version(store, run_id, plan, p, v), _version(store, run_id, plan, p, v - 1)
        b = {n: ckpt.tensors[tensor_key(p, "momentum", n)] for n in cur}
        g = {n: (prev[n] - cur[n]) / eta - lam * mu * b[n] for n in cur}
        parts[p] = {"version": v, "eta_g": eta * _norm(g), "eta_mu_b": eta * mu * _norm(b),
                    "step": _norm({n: prev[n] - cur[n] for n in cur})}
        prev_all.update(prev)
        final_all.update(cur)
        sgd_all.update({n: prev[n] - eta * g[n] for n in cur})
    return {"last_step_parts": parts, "final_loss": _loss(cfg, split, final_all),
            "without_last_merges": _loss(cfg, split, prev_all), "last_merges_as_sgd": _loss(cfg, split, sgd_all)}


def trace_last_merges(cfg: Config, rp, ckpt: Checkpoint, split: HeldoutSplit, last: int) -> list[dict]:
    """One row per merge of the last ``last`` (oldest first), then one row with the last steps'
    split and the counterfactual losses (see the module's docstring). ``rp`` is the finished
    :class:`~diloco_async.run.RunProcesses`."""
    store, run_id = rp.store, rp.run_id
    plan = FragmentPlan.from_json(store.get_json(keys.plan_key(run_id))["plan"])
    merges = [json.loads(line) for line in store.get_unverified(keys.merge_log_key(run_id, str(rp.epoch)))
              .decode().splitlines() if line.strip()]
    drain_s = drain_started_s(rp.sync.log_path.read_text(errors="replace"))
    final = {int(p): int(v) for p, v in ckpt.manifest["versions"].items()}
    values: dict[str, torch.Tensor] = {}
    for p, v in final.items():
        values.update(_version(store, run_id, plan, p, v))
    rows = []
    for rec in reversed(merges[-last:]):  # newest first: undo one merge at a time
        p, v = rec["fragment"], rec["version"]
        cur, prev = _version(store, run_id, plan, p, v), _version(store, run_id, plan, p, v - 1)
        values.update(cur)
        contribs = rec["contributions"]
        rows.append({"t_from_drain_s": None if drain_s is None else round(rec["t"] - drain_s, 2),
                     "fragment": p, "round": rec["round"], "version": v, "quorum": len(contribs),
                     "c_steps": [c["c_steps"] for c in contribs], "c_tokens": [c["c_tokens"] for c in contribs],
                     "staleness": [v - 1 - c["base_version"] for c in contribs],
                     "step_norm": round(_norm({n: cur[n] - prev[n] for n in cur}), 5),
                     "loss_after": round(_loss(cfg, split, values), 5)})
        values.update(prev)
    rows.reverse()
    return rows + [_last_steps(cfg, store, run_id, plan, ckpt, final, split)]
