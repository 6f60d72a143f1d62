"""`make bench-chaos`, last step: the goodput and loss bars of the chaos scenarios, as ratios.

Reads the files written by ``diloco-async chaos --out FILE`` for the storm, failure-free and
straggler scenarios of the same ``make bench-chaos`` run and prints one line per bar:

* storm: Decoupled DiLoCo's compute goodput >= 0.9 x the slots' mean availability, and >= 3 x DDP's;
* failure-free: Decoupled DiLoCo's eval loss at equal tokens <= 1.03 x DDP's;
* storm against failure-free: Decoupled DiLoCo's eval loss at equal tokens under the storm
  <= 1.05 x failure-free DDP's at the same token count (both scenarios read it at ``eval_tokens``);
* straggler: K = 1 with grace keeps compute goodput >= 0.98, with K = M shown beside it.

Exit status 1 when a bar is missed or a figure is missing (a method that never reached the token
count), 0 otherwise.

Usage: python -m benchmarks.chaos_bars STORM.json FAILURE_FREE.json [STRAGGLER.json]
"""

from __future__ import annotations

import json
import sys

from diloco_async.chaos.measure import eval_at


def _rows(path: str) -> tuple[dict, dict[str, dict]]:
    doc = json.loads(open(path).read())
    return doc, {r["method"]: r for r in doc["rows"]}


def bars(storm_path: str, ff_path: str,
         straggler_path: str | None = None) -> list[tuple[str, float | None, float, str]]:
    """The bars as ``(name, measured ratio or None, limit, 'min' | 'max')``."""
    storm, st = _rows(storm_path)
    _, ff = _rows(ff_path)
    out: list[tuple[str, float | None, float, str]] = []
    dec, ddp = st["decoupled"], st["ddp"]
    out.append(("storm: decoupled compute goodput / mean availability", dec["compute_goodput"] / storm["availability"],
                0.9, "min"))
    out.append(("storm: decoupled compute goodput / DDP's", dec["compute_goodput"] / max(ddp["compute_goodput"], 1e-9),
                3.0, "min"))
    ff_dec, ff_ddp = ff["decoupled"]["eval_loss_equal_tokens"], ff["ddp"]["eval_loss_equal_tokens"]
    out.append(("failure-free: decoupled eval loss / DDP's, equal tokens",
                None if ff_dec is None or ff_ddp is None else ff_dec / ff_ddp, 1.03, "max"))
    # the storm's token count, read on the failure-free DDP curve
    tokens = float(storm.get("eval_tokens") or 0) or None
    storm_dec = dec["eval_loss_equal_tokens"]
    ref = eval_at(ff["ddp"]["eval_curve"], tokens)[1] if tokens and ff["ddp"].get("eval_curve") else None
    out.append(("storm decoupled / failure-free DDP eval loss, equal tokens",
                None if storm_dec is None or ref is None else storm_dec / ref, 1.05, "max"))
    if straggler_path:
        _, sg = _rows(straggler_path)
        out.append(("straggler: K=1 with grace, compute goodput", sg["decoupled"]["compute_goodput"], 0.98, "min"))
        if "sync-diloco" in sg:
            out.append(("straggler: K=M (shown, no bar), compute goodput", sg["sync-diloco"]["compute_goodput"], 0.0,
                        "min"))
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    ok = True
    for name, value, limit, kind in bars(*argv):
        if value is None:
            ok = False
            print(f"{name:62s}      n/a   (not reached)  MISSED")
            continue
        passed = value >= limit if kind == "min" else value <= limit
        ok &= passed
        op = ">=" if kind == "min" else "<="
        print(f"{name:62s} {value:8.3f}   {op} {limit:<6g}  {'ok' if passed else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
