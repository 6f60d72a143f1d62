"""`make bench-chaos`, last step: the goodput and loss bars of the chaos scenarios, as ratios.

Reads the files written by ``diloco-async chaos --out FILE`` for the storm, failure-free and
straggler scenarios of the same ``make bench-chaos`` run and prints one line per bar:

* storm: Decoupled DiLoCo's compute goodput >= 0.9 x the slots' mean availability, >= 3 x DDP's,
  and >= synchronous DiLoCo's + 0.2; its final eval loss (equal time) <= ln 256 - 1 nats/byte
  (it learned under the failures);
* failure-free: Decoupled DiLoCo's eval loss at equal tokens <= 1.03 x DDP's;
* storm against failure-free: Decoupled DiLoCo's eval loss at equal tokens under the storm
  <= 1.05 x failure-free DDP's at the same token count (both scenarios read it at ``eval_tokens``);
* straggler: K = 1 with grace keeps compute goodput >= 0.98, and >= K = M's + 0.15 (K = M shown);
* every method of every file: its goodput window ends <= 1 s past the scenario's wall time (each
  method gets the same wall time; the scenario's ``wall_s`` is the file's, else that of the shipped
  ``configs/chaos/<scenario>.toml``).

tests/system/test_chaos.py runs the CI scenarios for what each method did under the schedule;
these figures are judged here, on the full scenarios.

Exit status 1 when a bar is missed or a figure is missing (a method that never reached the token
count), 0 otherwise.

Usage: python -m benchmarks.chaos_bars STORM.json FAILURE_FREE.json [STRAGGLER.json]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from diloco_async.chaos.measure import eval_at

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: str) -> tuple[dict, dict[str, dict]]:
    doc = json.loads(open(path).read())
    return doc, {r["method"]: r for r in doc["rows"]}


def _scenario_wall_s(doc: dict) -> float | None:
    """The wall time each method of ``doc`` was given: its ``wall_s``, else the shipped scenario's."""
    if doc.get("wall_s") is not None:
        return float(doc["wall_s"])
    from diloco_async.chaos import load_scenario

    path = ROOT / "configs" / "chaos" / f"{doc.get('scenario')}.toml"
    return load_scenario(path).scenario.wall_s if path.is_file() else None


def _window_overshoot_s(docs: list[dict]) -> float | None:
    """Largest (goodput window - scenario wall time) over every method of ``docs``, seconds."""
    over = []
    for doc in docs:
        wall = _scenario_wall_s(doc)
        if wall is None:
            return None
        over += [float(r["wall_s"]) - wall for r in doc["rows"]]
    return max(over) if over else None


def bars(storm_path: str, ff_path: str,
         straggler_path: str | None = None) -> list[tuple[str, float | None, float, str]]:
    """The bars as ``(name, measured ratio or None, limit, 'min' | 'max')``."""
    storm, st = _rows(storm_path)
    ff_doc, ff = _rows(ff_path)
    docs = [storm, ff_doc]
    out: list[tuple[str, float | None, float, str]] = []
    dec, ddp = st["decoupled"], st["ddp"]
    out.append(("storm: decoupled compute goodput / mean availability", dec["compute_goodput"] / storm["availability"],
                0.9, "min"))
    out.append(("storm: decoupled compute goodput / DDP's", dec["compute_goodput"] / max(ddp["compute_goodput"], 1e-9),
                3.0, "min"))
    out.append(("storm: decoupled compute goodput - sync-diloco's",
                dec["compute_goodput"] - st["sync-diloco"]["compute_goodput"] if "sync-diloco" in st else None,
                0.2, "min"))
    out.append(("storm: decoupled eval loss at equal time (nats/byte)", dec["eval_loss_equal_time"],
                math.log(256) - 1.0, "max"))
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
        sg_doc, sg = _rows(straggler_path)
        docs.append(sg_doc)
        k1 = sg["decoupled"]["compute_goodput"]
        out.append(("straggler: K=1 with grace, compute goodput", k1, 0.98, "min"))
        out.append(("straggler: K=1 compute goodput - K=M's",
                    k1 - sg["sync-diloco"]["compute_goodput"] if "sync-diloco" in sg else None, 0.15, "min"))
        if "sync-diloco" in sg:
            out.append(("straggler: K=M (shown, no bar), compute goodput", sg["sync-diloco"]["compute_goodput"], 0.0,
                        "min"))
    out.append(("every method's window past the scenario's wall time (s)", _window_overshoot_s(docs), 1.0, "max"))
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
