"""The ``diloco-async`` command line (subcommands import lazily, so ``diloco-async --help`` is fast)."""

from __future__ import annotations

import argparse
import sys

from diloco_async.flows import interrupts
from diloco_async.flows.alerts import add_alerts_parser  # constants and argparse only: Prefect is imported when it runs
from diloco_async.flows.plan_cli import add_plan_parser  # argparse only: the plan's library is imported when it runs
from diloco_async.flows.recipes_cli import print_recipes  # imports the library when it runs
from diloco_async.flows.runs_cli import add_runs_parser  # argparse only: the store is opened when it runs
from diloco_async.flows.wan_cli import add_wan_parser  # argparse only: the flow is imported when the command runs

__all__ = ["build_parser", "main"]

# Quiet, project-local defaults for the embedded Prefect server and MLflow (as the Makefile's); set ones win.
_ENV_DEFAULTS = {
    "PREFECT_HOME": ".local/prefect",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_CLIENT_MAX_RETRIES": "1",  # after Ctrl-C has also stopped the temporary server: exit soon
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}


def _set_environment_defaults() -> None:
    """Set the embedded defaults. Before anything imports Prefect: its settings are read once, at
    import (a startup timeout set later would be ignored)."""
    import os

    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["PREFECT_HOME"] = os.path.abspath(os.environ["PREFECT_HOME"])


def _make_prefect_home() -> None:
    """Make ``PREFECT_HOME`` with its parents: Prefect makes its home at import, not the folders
    above it (a new folder has no ``.local/``), and warns. Called once the command's checks passed,
    just before the flow's module imports Prefect (a refused command leaves nothing behind)."""
    import os

    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)


def _check_config(path: str | None, overrides: list[str]) -> str | None:
    """Resolve the recipe (a path or a shipped name), validate it and list its corpus URLs before
    anything starts; print the error (no traceback) and return None if bad, else the recipe's path."""
    from diloco_async.api import load_run_config  # the Python API raises the same errors

    try:
        resolved = load_run_config(path, overrides)[1]
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    return resolved


def _weak_secret() -> bool:
    """Print the error and return True when ``$DILOCO_RUN_TOKEN`` is set but too weak (unset: the
    flow makes a fresh random one)."""
    import os

    from diloco_async.protocol.auth import check_run_secret
    from diloco_async.protocol.client import TOKEN_ENV

    secret = os.environ.get(TOKEN_ENV, "")
    try:
        if secret:
            check_run_secret(secret, TOKEN_ENV)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return True
    return False


def _train(args: argparse.Namespace) -> int:
    recipe = _check_config(args.config, args.set or [])
    if recipe is None or _weak_secret():
        return 2
    _make_prefect_home()
    from diloco_async.flows.train import run_train_cli

    return interrupts.run_flow(run_train_cli, recipe, overrides=args.set or [])


def _validate(args: argparse.Namespace) -> int:
    """Print every check of the recipe; exit 0 when all pass, 2 (naming the field) when one fails."""
    from diloco_async.storage.options import storage_options_from_env
    from diloco_async.validate import validate_recipe

    checks = validate_recipe(args.recipe, args.set or [], storage_options_from_env(), fill_caches=args.fill_caches)
    for c in checks:
        head, *rest = c.detail.splitlines() or [""]
        where = "" if c.ok else f" [{c.field}]"
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<10}{where} {head}")
        for line in rest:
            print(f"{'':15}{line}")
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"error: {', '.join(c.field or c.name for c in failed)} invalid", file=sys.stderr)
        return 2
    if args.write_resolved:  # what `python -m diloco_async.server --resolved-config` takes (a run by hand)
        from diloco_async.flows.resolve import write_recipe_resolved
        try:
            written = write_recipe_resolved(args.recipe, args.set or [], args.write_resolved)
        except OSError as err:
            print(f"error: --write-resolved {args.write_resolved}: cannot write the resolved config there "
                  f"({type(err).__name__}: {err})", file=sys.stderr)
            return 2
        print(f"resolved config: {written}")
    print("valid: no process started, no run created" + (", caches filled" if args.fill_caches else ""))
    return 0


def _resume(args: argparse.Namespace) -> int:
    from diloco_async.flows.resolve import resume_config
    from diloco_async.storage.options import storage_options_from_env
    from diloco_async.sync import open_run
    from diloco_async.validate import resolve_recipe

    if _weak_secret():
        return 2
    try:  # refuse a wrong URL or a config that differs from the checkpoint's before starting anything
        config = str(resolve_recipe(args.config)) if args.config else None
        options = storage_options_from_env()
        given = resume_config(args.checkpoint_url, config, args.set or [], options)
        open_run(args.checkpoint_url, given, options)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the store could not be read (no credentials, no route): say so, no trace
        print(f"error: resume {args.checkpoint_url!r}: cannot read the store ({type(err).__name__}: {err})",
              file=sys.stderr)
        return 2
    _make_prefect_home()
    from diloco_async.flows.train import run_resume_cli

    return interrupts.run_flow(run_resume_cli, args.checkpoint_url, config, overrides=args.set or [])


def _status(args: argparse.Namespace) -> int:
    from diloco_async.flows.status_view import main as status_main
    return status_main(args.sync_url, watch=args.watch, wide=args.wide)


def _chaos(args: argparse.Namespace) -> int:
    from diloco_async.chaos import METHODS, load_scenario, method_config
    from diloco_async.chaos.scenario import with_user_overrides
    from diloco_async.config.schema import load_config
    from diloco_async.flows.outpath import check_out

    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    if _weak_secret():
        return 2
    try:  # refuse a bad scenario, method or override before starting anything
        sc = load_scenario(args.scenario)
        bad = [m for m in methods or [] if m not in METHODS]
        if bad:
            raise ValueError(f"unknown method {', '.join(bad)}; known: {', '.join(METHODS)}")
        with_user_overrides(sc, args.set or [], methods)  # the fields the harness sets; ddp with a [link]
        try:
            base = load_config(sc.scenario.config, [*sc.scenario.overrides, *(args.set or [])])
            for m in methods or sc.scenario.methods:
                method_config(sc, m, base)
        except ValueError as err:  # name the field first, not the harness's own overrides
                lines = str(err).splitlines()
                raise ValueError("invalid override: " + "; ".join(x.strip() for x in lines[1:]) if len(lines) > 1
                                 else str(err)) from None
        check_out(args.out, "file")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _make_prefect_home()
    from diloco_async.flows.chaos import run_chaos_cli

    interrupts.STOP["at_once"] = True
    return interrupts.run_flow(run_chaos_cli, args.scenario, methods, args.json, args.set or [], args.out,
                               args.full_speed)


def _token(args: argparse.Namespace) -> int:
    """Print one learner's token, derived from the run secret in ``$DILOCO_RUN_TOKEN``."""
    import os
    import re

    from diloco_async.protocol.auth import learner_token
    from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
    from diloco_async.protocol.messages import LEARNER_ID_PATTERN

    secret = os.environ.get(TOKEN_ENV, "")
    if not secret:
        print(f"error: {TOKEN_ENV} is not set: the run's secret derives every learner's token", file=sys.stderr)
        return 2
    if _weak_secret():
        return 2
    if not re.match(LEARNER_ID_PATTERN, args.learner_id):
        print(f"error: learner id {args.learner_id!r} does not match {LEARNER_ID_PATTERN}", file=sys.stderr)
        return 2
    token = learner_token(secret, args.run_id, args.learner_id)
    print(f"{LEARNER_TOKEN_ENV}={token}" if args.env else token)
    return 0


def _alerts(args: argparse.Namespace) -> int:
    """Create or update the webhook block and the automation that notify on a failed run."""
    import json
    import os

    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # before Prefect is imported
    from diloco_async.flows.alerts import api_url, install_alerts

    if not api_url():
        print("error: PREFECT_API_URL is not set: alerts live on a Prefect server that outlives this command "
              "(e.g. `make ui` starts one; export PREFECT_API_URL=http://127.0.0.1:4200/api)", file=sys.stderr)
        return 2
    try:
        payload = json.loads(args.payload) if args.payload else None
        flows = tuple(f.strip() for f in args.flows.split(",") if f.strip())
        done = install_alerts(args.webhook, flows=flows, block_name=args.block_name,
                              automation_name=args.name, payload=payload)
    except (ValueError, json.JSONDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{'created' if done.created else 'updated'} automation {args.name!r} ({done.automation_id}): "
          f"a Failed or Crashed run of {', '.join(flows)} notifies block {args.block_name!r} "
          f"({done.block_document_id}) at {args.webhook} on the Prefect server {api_url()}")
    return 0


def _simulate(argv: list[str]) -> int:
    from diloco_async.flows.simulate_cli import main as sim_main
    return sim_main(argv)


_DESCRIPTION = """Train one model on many independent, unreliable learners with Decoupled DiLoCo:
learners never wait for each other; a synchronizer merges their outer gradients per fragment
(minimum quorum, adaptive grace window, token-weighted RDA) and publishes new versions."""

_EPILOG = """examples:
  diloco-async train                                   the default recipe (configs/default.toml)
  diloco-async train --set learners.count=2            override any recipe field
  diloco-async recipes                                 the shipped recipes, by name
  diloco-async validate default                        check a recipe without running anything
  diloco-async status http://127.0.0.1:40929 --watch   follow a running synchronizer
  diloco-async resume file://.local/store/<run_id>     continue from the newest checkpoint
  diloco-async runs ls file://.local/store             a store's runs, checkpoints and their state
  diloco-async chaos --scenario configs/chaos/storm.toml
  diloco-async ablate --suite configs/ablations/merge.toml   a paper ablation, with intervals
  diloco-async alerts --webhook https://hooks.slack.com/services/...   notify when a run fails
  diloco-async plan --params 12B --regions 4 --link-gbps 2 --step-s 3   memory and links, before renting
  diloco-async simulate --help"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("diloco-async")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_validate_parser(sub) -> None:
    p = sub.add_parser("validate", help="check a recipe: config, devices, store, data, tokenizer, model, "
                       "fragment plan (starts nothing, writes nothing)")
    p.add_argument("recipe", nargs="?", default=argparse.SUPPRESS, help="a TOML file or a recipe's name")
    p.add_argument("--config", "--recipe", dest="recipe", default="default", help="the same, as for train")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--write-resolved", default=None, metavar="DIR",
                   help="when valid, write DIR/resolved-config.json: the recipe with its overrides, for "
                        "python -m diloco_async.server --resolved-config (a run by hand)")
    p.add_argument("--fill-caches", action="store_true",
                   help="download the corpus and build the tokens and model copies into the recipe's caches "
                        "(data.cache_dir, data.token_cache_dir, model.hf.cache_dir), as the first run would; "
                        "by default validate writes no file outside a temporary folder")
    p.set_defaults(func=_validate)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser (imports no flow); ``simulate`` parses its own flags (:func:`main`)."""
    parser = argparse.ArgumentParser(prog="diloco-async", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run a training job (Prefect flow `train`)")
    p_train.add_argument("--config", "--recipe", dest="config", default="default",
                         help="recipe: a TOML file, or a shipped recipe's name (see `recipes`; default: default)")
    p_train.add_argument(
        "--set", action="append", metavar="KEY=VALUE",
        help="override a config field, e.g. --set learners.count=2 (repeatable)",
    )
    p_train.set_defaults(func=_train)
    _add_validate_parser(sub)
    sub.add_parser("recipes", help="list the shipped recipes with their descriptions and prerequisites, and the "
                   "chaos, WAN and ablation scenario files").set_defaults(func=print_recipes)
    p_resume = sub.add_parser("resume", help="continue a run from a checkpoint (Prefect flow `resume`)")
    p_resume.add_argument("checkpoint_url",
                          help="{store}/{run_id}/checkpoints/{seq}, or {store}/{run_id} for the newest")
    p_resume.add_argument("--config", "--recipe", dest="config", default=None,
                          help="recipe file or name (default: the run's own config from the store)")
    p_resume.add_argument("--set", action="append", metavar="KEY=VALUE",
                          help="override a field, e.g. --set budget.tokens=12000000 to extend the run")
    p_resume.set_defaults(func=_resume)
    p_status = sub.add_parser("status", help="show a running synchronizer's learners and rounds")
    p_status.add_argument("sync_url", help="e.g. http://127.0.0.1:40929 (printed by train); with synchronizer "
                                          "shards their URLs comma-separated in shard order: the run's figures "
                                          "aggregated, a row per shard")
    p_status.add_argument("--watch", action="store_true", help="refresh every 2 s until the run ends")
    p_status.add_argument("--wide", action="store_true", help="more columns: each learner's bytes per token and "
                          "link figures, the learner ids of each round (the default fits 100 columns)")
    p_status.set_defaults(func=_status)
    add_runs_parser(sub)
    p_chaos = sub.add_parser("chaos", help="run DDP, synchronous and Decoupled DiLoCo under one fault schedule")
    p_chaos.add_argument("--scenario", required=True, help="scenario file, e.g. configs/chaos/storm.toml")
    p_chaos.add_argument("--methods", default=None, help="comma-separated subset of ddp,sync-diloco,decoupled")
    p_chaos.add_argument("--json", action="store_true", help="print the table as a JSON list (one object per method)")
    p_chaos.add_argument("--set", action="append", metavar="KEY=VALUE",
                         help="override a field of every method's recipe, e.g. --set run.store=s3://bucket/chaos")
    p_chaos.add_argument("--out", default=None, metavar="FILE", help="also write every row (with availability, "
                         "tokens and the eval-loss curve) to FILE as JSON")
    p_chaos.add_argument("--full-speed", action="store_true",
                         help="run the scenario with every learner at full speed (no speed factors, no slot's own "
                              "storage faults, the link unshaped): the heterogeneity bars' baseline")
    p_chaos.set_defaults(func=_chaos)
    add_wan_parser(sub)
    add_plan_parser(sub)
    p_token = sub.add_parser("token", help="print a learner's own token (run secret: $DILOCO_RUN_TOKEN)")
    p_token.add_argument("--run-id", required=True, help="the run's id (printed by train, in the store's layout)")
    p_token.add_argument("--learner-id", required=True, help="e.g. learner-4")
    p_token.add_argument("--env", action="store_true", help="print DILOCO_LEARNER_TOKEN=<token> (for an env file)")
    p_token.set_defaults(func=_token)
    add_alerts_parser(sub, _alerts)
    from diloco_async.flows.certs import add_certs_parser  # cryptography only, no flow
    add_certs_parser(sub)
    from diloco_async.flows.ablate_cli import add_ablate_parser  # argparse only; the flow is imported when it runs
    add_ablate_parser(sub, interrupts.run_flow, _weak_secret)
    sub.add_parser("simulate", help="goodput simulator at paper scale (see `simulate --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _set_environment_defaults()
    # `simulate` owns its own flags; hand the rest of the line to it untouched.
    if argv and argv[0] == "simulate":
        return _simulate(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
