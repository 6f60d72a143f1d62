"""``diloco-async wan``: the parser and the handler of the subcommand (the flow is ``diloco_async/flows/wan.py``).

``diloco-async wan --scenario FILE [--methods ddp,decoupled] [--seed N] [--unshaped] [--json]
[--out FILE] [--set KEY=VALUE ...]`` runs the methods of a WAN scenario over its shaped links;
``diloco-async wan --cleanup [--prefix dlw]`` removes every namespace, veth and qdisc the
harness left behind (after a crash) and prints what it removed.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_wan_parser", "wan_command"]


def add_wan_parser(sub) -> None:
    """Add the ``wan`` subcommand to the ``diloco-async`` subparsers ``sub``."""
    p = sub.add_parser("wan", help="run DDP, synchronous and Decoupled DiLoCo over emulated regions joined by "
                                   "shaped links (needs root, iproute2 tc)")
    p.add_argument("--scenario", default=None, help="WAN scenario file, e.g. configs/wan/wan-4-regions.toml")
    p.add_argument("--methods", default=None, help="comma-separated subset of ddp,sync-diloco,decoupled")
    p.add_argument("--seed", type=int, default=None, help="run.seed of every method (default: the recipe's)")
    p.add_argument("--unshaped", action="store_true",
                   help="the same processes without namespaces or shaping, on loopback (the tokens/s reference)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per method (a list): method, time_to_target_s, bytes_per_token, "
                        "eval_loss_equal_tokens, link_rates")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the whole report to FILE as JSON")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of every method's recipe")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the namespaces, veths and qdiscs a crashed WAN run left, then exit")
    p.add_argument("--prefix", default="dlw", help="name prefix of what --cleanup removes (default: %(default)s)")
    p.set_defaults(func=wan_command)


def _cleanup(prefix: str) -> int:
    from diloco_async.wan.netns import cleanup

    try:
        removed = cleanup(prefix)
    except Exception as err:  # not root, no `ip`: say why
        print(f"error: cleanup failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print("\n".join(removed) if removed else f"nothing to remove (prefix {prefix!r})")
    return 0


def _check(args: argparse.Namespace, methods: list[str] | None) -> None:
    """Refuse a bad scenario, method or override before starting anything (ValueError, FileNotFoundError)."""
    from diloco_async.chaos import METHODS, check_user_overrides
    from diloco_async.config.schema import load_config
    from diloco_async.flows.outpath import check_out
    from diloco_async.wan.scenario import load_wan_scenario, wan_config

    sc = load_wan_scenario(args.scenario)
    bad = [m or "''" for m in methods or [] if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method {', '.join(bad)}; known: {', '.join(METHODS)}")
    check_user_overrides(sc, args.set or [])
    base = load_config(sc.scenario.config, [*sc.scenario.overrides, *(args.set or [])])
    for m in methods or sc.scenario.methods:
        wan_config(sc, m, base, args.seed)
    check_out(args.out, "file")


def wan_command(args: argparse.Namespace) -> int:
    """The handler: cleanup, or check the scenario then run the flow (exit 2 on bad input)."""
    if args.cleanup:
        return _cleanup(args.prefix)
    if not args.scenario:
        print("error: give --scenario FILE (or --cleanup)", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",")] if args.methods is not None else None
    try:
        _check(args, methods)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from diloco_async.flows import interrupts
    from diloco_async.flows.wan import run_wan_cli

    interrupts.STOP["at_once"] = True  # a comparison cut short measures nothing: the first signal stops it
    return interrupts.run_flow(run_wan_cli, args.scenario, methods, args.json, args.set or [], args.out, args.seed,
                         not args.unshaped)
