"""``diloco-async plan``: the capacity plan of a run before anything starts (the math is
:mod:`diloco_async.capacity`; formulas in docs/capacity-plan.md).

``diloco-async plan [--recipe NAME|FILE] [--set KEY=VALUE ...] [--params N | --hf-config FILE]
[--learners M] [--devices-per-learner N] [--parallelism ddp|fsdp] [--regions R] [--link-gbps 2,5]
[--codec C] [--download-codec C] [--sync-every H] [--fragments P] [--overlap TAU] [--shards S]
[--step-s SECONDS] [--budget-tokens N] [--json]``; ``diloco-async plan --paper`` plans the paper's
12B run beside the paper's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

__all__ = ["add_plan_parser", "plan_command", "parse_count"]

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A count as ``12000000000``, ``12e9``, ``12B``, ``350M`` or ``1.5k``.

    Raises:
        ValueError: not a number, or not a whole number of units.
    """
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a count (e.g. 12e9, 12B, 350M)")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--link-gbps {text!r}: give Gbit/s as numbers, one or one per region "
                         "(e.g. 2,5,5,2)") from None


def add_plan_parser(sub) -> None:
    """Add the ``plan`` subcommand to the ``diloco-async`` subparsers ``sub``."""
    p = sub.add_parser("plan", help="capacity plan: memory per process, bytes per link, the link rate learners "
                       "need and the speed-up over DDP (starts nothing)")
    p.add_argument("--config", "--recipe", dest="config", default="default",
                   help="recipe (file or shipped name) whose model and settings are the defaults (default: default)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--params", default=None, help="a bare parameter count instead of the recipe's model "
                       "(12e9, 12B, 350M): fragments of params/P, activations not modelled")
    model.add_argument("--hf-config", default=None, metavar="FILE",
                       help="a Hugging Face config.json (or its folder) instead of the recipe's model")
    p.add_argument("--learners", type=int, default=None, help="M (default: learners.count)")
    p.add_argument("--devices-per-learner", type=int, default=None,
                   help="N ranks per learner (default: learners.nproc_per_learner x nnodes)")
    p.add_argument("--parallelism", default="ddp", help="ddp (this project's learners) or fsdp (planning only: "
                   "each rank holds 1/N of the state)")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="where ranks train (default: the recipe's learners.device; anything but cpu is gpu)")
    p.add_argument("--batch", type=int, default=None, help="windows per rank per step (default: learners.batch_size)")
    p.add_argument("--context", type=int, default=None, help="tokens per window (default: model.context)")
    p.add_argument("--regions", type=int, default=1, help="R regions; learner i in region i mod R (default: 1)")
    p.add_argument("--link-gbps", default="", help="each region's link to the synchronizer's, Gbit/s: one value, "
                   "or one per region (e.g. 2,5,5,2)")
    p.add_argument("--ddp-grads", default="fp32", help="what the DDP baseline all-reduces: fp32 (default) or bf16")
    p.add_argument("--codec", default=None, help="upload codec (default: learners.codec)")
    p.add_argument("--download-codec", default=None, help="download codec (default: synchronizer.download_codec)")
    p.add_argument("--sync-every", type=int, default=None, help="H (default: synchronizer.sync_every)")
    p.add_argument("--fragments", type=int, default=None, help="P (default: synchronizer.num_fragments)")
    p.add_argument("--overlap", type=int, default=None, help="tau (default: synchronizer.max_open_rounds)")
    p.add_argument("--shards", type=int, default=1, help="S synchronizer shards, each 1/S of the fragments")
    p.add_argument("--step-s", type=float, default=None,
                   help="compute seconds of one inner step (no network wait): needed for rates and the speed-up")
    p.add_argument("--budget-tokens", default=None, help="tokens of the run (default: budget.tokens): bytes per "
                   "token over the run, with each learner's join and last round")
    p.add_argument("--paper", action="store_true", help="the paper's 12B run over 4 regions, beside its figures")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=plan_command)


def _model(args: argparse.Namespace, cfg):
    from diloco_async.capacity import shape_from_config, shape_from_count, shape_from_hf_config

    if args.params is not None:
        return shape_from_count(parse_count(args.params))
    if args.hf_config is not None:
        path = Path(args.hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            fields = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--hf-config {args.hf_config}: cannot read a JSON config ({type(err).__name__}: "
                             f"{err})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--hf-config {args.hf_config}: not a JSON object")
        return shape_from_hf_config(fields, source=str(path))
    return shape_from_config(cfg, source=f"recipe {args.config}")


def _pick(value, default):
    return default if value is None else value


def build_inputs(args: argparse.Namespace):
    """The plan's inputs: the recipe's settings, with the command line's on top.

    Raises:
        ValueError, FileNotFoundError: a bad recipe, override, model or value (the message names it).
    """
    from diloco_async.capacity import LinkSetup
    from diloco_async.capacity.recipe import inputs_from_config
    from diloco_async.config.schema import load_config
    from diloco_async.validate import resolve_recipe

    cfg = load_config(str(resolve_recipe(args.config)), args.set or [])
    links = LinkSetup(regions=args.regions, gbps=_rates(args.link_gbps), ddp_grad_dtype=args.ddp_grads)
    base = inputs_from_config(cfg, model=_model(args, cfg), step_s=args.step_s, links=links, shards=args.shards)
    lr, s = base.learners, base.sync
    learners = dataclasses.replace(
        lr, count=_pick(args.learners, lr.count), devices=_pick(args.devices_per_learner, lr.devices),
        parallelism=args.parallelism, accelerator=args.device == "gpu" if args.device else lr.accelerator,
        batch_per_rank=_pick(args.batch, lr.batch_per_rank), context=_pick(args.context, lr.context))
    sync = dataclasses.replace(
        s, sync_every=_pick(args.sync_every, s.sync_every), fragments=_pick(args.fragments, s.fragments),
        overlap=_pick(args.overlap, s.overlap), codec=_pick(args.codec, s.codec),
        download_codec=_pick(args.download_codec, s.download_codec))
    budget = parse_count(args.budget_tokens) if args.budget_tokens is not None else base.budget_tokens
    return dataclasses.replace(base, learners=learners, sync=sync, budget_tokens=budget)


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.3g} B"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _memory_lines(title: str, mem) -> list[str]:
    lines = [f"{title:<34} host {_size(mem.host_bytes):>10}   device {_size(mem.device_bytes):>10}   "
             f"disk {_size(mem.disk_bytes):>10}"]
    lines += [f"  {p.name:<22} {p.where:<6} {_size(p.nbytes):>10}   {p.why}" for p in mem.parts]
    lines += [f"  note: {n}" for n in mem.notes]
    return lines


def _traffic_lines(plan) -> list[str]:
    t, ddp = plan.learner, plan.ddp
    out = ["", f"traffic of one learner            {'up':>12} {'down':>12}",
           f"  payload per inner step          {_size(t.up_per_step):>12} {_size(t.down_per_step):>12}",
           f"  on the wire per token           {_size(t.up_per_token):>12} {_size(t.down_per_token):>12}"]
    if t.run_up_per_token is not None:
        out.append(f"  per token over the run          {_size(t.run_up_per_token):>12} "
                   f"{_size(t.run_down_per_token):>12}"
                   f"   ({t.run_tokens_per_learner:,.0f} tokens each; join {_size(t.join_down)} down, last round "
                   f"{_size(t.drain_up)} up)")
    if ddp.regions == 1:
        return [*out, "", "DDP over the same links: one region, so its all-reduce crosses no WAN link (give --regions)"]
    return [*out, "", f"DDP over the same links: ring all-reduce of {ddp.grad_dtype} gradients across {ddp.regions} "
            f"regions, {_size(ddp.allreduce_wire_per_step)} each way per link per step, "
            f"{_size(ddp.bytes_per_token)} per token each way"]


def _link_lines(plan) -> list[str]:
    ddp = plan.ddp
    out = ["", f"links (step {plan.inputs.learners.step_s:g} s; on the wire, each way)",
           f"  {'region':>6} {'learners':>8} {'up/s':>10} {'down/s':>10} {'mean need':>14} {'no-wait need':>14} "
           f"{'rate Gb/s':>9} {'utilisation':>11}"]
    for link in plan.links:
        out.append(f"  {link.region:>6} {link.learners:>8} {_size(link.up_bytes_per_s):>10} "
                   f"{_size(link.down_bytes_per_s):>10} {_num(link.mean_gbps):>9} Gb/s "
                   f"{_num(link.no_wait_gbps):>9} Gb/s {_num(link.rate_gbps):>9} {_num(link.utilisation, '.2f'):>11}")
    for link in plan.links:
        if link.rate_gbps is not None and link.throughput is not None and link.throughput < 1:
            out.append(f"  region {link.region}: its link is below the mean load: it carries {link.throughput:.2f} "
                       "of its learners' contributions")
        elif link.rate_gbps is not None and link.no_wait_gbps is not None and link.rate_gbps < link.no_wait_gbps:
            out.append(f"  region {link.region}: a fragment's round trip takes longer than tau steps: contributions "
                       "may miss their round (counted late)")
    if ddp.regions > 1:
        out.append(f"  DDP needs {_num(ddp.needed_gbps)} Gbit/s per link to fit its all-reduce in one step; "
                   f"DDP / Decoupled DiLoCo: {_num(plan.bandwidth_ratio, '.1f')}x")
    if plan.speedup is not None and ddp.step_s is not None:
        out.append(f"  on these links a DDP step takes {ddp.step_s:.3g} s ({ddp.allreduce_s:.3g} s all-reduce): "
                   f"predicted speed-up of Decoupled DiLoCo over DDP {plan.speedup:.1f}x")
    return out + [f"  synchronizer shard {x.shard}: fetches {_size(x.in_bytes_per_s)}/s, publishes "
                  f"{_size(x.out_bytes_per_s)}/s" for x in plan.shards]


def render(plan) -> str:
    """The plan as the terminal shows it."""
    inp, m, lr, s = plan.inputs, plan.inputs.model, plan.inputs.learners, plan.inputs.sync
    shard_frags = max(len(x.fragments) for x in plan.shards)
    out = [f"capacity plan: {m.source}, {m.n_params:,} parameters; {lr.count} learners x {lr.devices} "
           f"{'GPU' if lr.accelerator else 'CPU'} rank(s) ({lr.parallelism}), {lr.tokens_per_step:,} tokens per "
           f"learner step; H = {s.sync_every}, P = {s.fragments}, tau = {s.overlap}, S = {s.shards}; codec "
           f"{s.codec} up, {s.download_codec} down; {inp.links.regions} region(s)", ""]
    out += _memory_lines("learner rank 0", plan.learner_rank)
    out += _memory_lines(f"synchronizer shard ({shard_frags} of {s.fragments} fragments)", plan.synchronizer_shard)
    out += _traffic_lines(plan)
    if lr.step_s is None:
        out += ["", "give --step-s SECONDS (compute time of one inner step) for bytes per second, link rates and "
                "the speed-up"]
    else:
        out += _link_lines(plan)
    return "\n".join(out)


def _paper(args: argparse.Namespace) -> int:
    from diloco_async.capacity.paper import ASSUMPTIONS, PAPER, paper_comparison

    cmp = paper_comparison(ddp_grad_dtype=args.ddp_grads, shards=args.shards)
    plan = cmp.plans["bf16"][PAPER["link_gbps"][0]]
    if args.json:
        print(json.dumps({"step_s": cmp.step_s, "assumptions": list(ASSUMPTIONS), "paper": dict(PAPER),
                          "rows": [dataclasses.asdict(r) for r in cmp.rows], "plan": plan.to_json()}, indent=1))
        return 0
    print(f"the paper's production run: {PAPER['params'] / 1e9:g}B parameters, {PAPER['regions']} regions, "
          f"{PAPER['link_gbps'][0]:g}-{PAPER['link_gbps'][1]:g} Gbit/s; H = {PAPER['sync_every']}, "
          f"P = {PAPER['fragments']}, tau = {PAPER['overlap']}")
    print(f"assumed (the paper does not say): {'; '.join(ASSUMPTIONS)}; step {cmp.step_s:.2f} s\n")
    print(f"{'figure':<52} {'predicted':>16} {'paper':>18}")
    for r in cmp.rows:
        print(f"{r.figure:<52} {r.predicted:>9.3g} {r.unit:<6} {r.paper:>18}")
    print()
    print("\n".join(_memory_lines(f"synchronizer shard, S = {args.shards} (bf16)", plan.synchronizer_shard)))
    print("differences explained: docs/capacity-plan.md#the-papers-production-run")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """The handler: build the inputs, print the plan (exit 2, naming the value, on bad input)."""
    from diloco_async.capacity import make_plan

    try:
        if args.paper:
            return _paper(args)
        plan = make_plan(build_inputs(args))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=1) if args.json else render(plan))
    return 0
