"""`make bench-kill`: the kill matrix (issue 14) on a tiny real run.

Runs :class:`diloco_async.chaos.kill_matrix.KillMatrix`: ``--learner-kills`` SIGKILLs of real
learners (40 % of them inside an upload, held in flight by the store's fault layer; the rest at
random moments), then ``--sync-kills`` cycles of SIGKILL of the synchronizer at a random moment
and a resume from its newest checkpoint. Prints the counts, each restart's time to its first
merge, and one bar per figure:

* learner SIGKILLs >= ``--learner-kills`` (at least one confirmed mid-upload);
* synchronizer SIGKILL + resume cycles >= ``--sync-kills``; every resume finished;
* every restart followed by a merge within 30 s;
* no merged contribution whose object is incomplete; no published version with a non-finite value;
* then the clean stop (benchmarks/ctrl_c.py, ``--ctrl-c-repeats`` times, 0 to skip): Ctrl-C typed
  into a pseudo-terminal on ``train``, ``status --watch`` and ``resume``; the median seconds from
  the Ctrl-C to the prompt of each <= 10, every stop exit status 130 without a traceback.

Exit status 1 when a bar is missed, 0 otherwise.

Usage: python -m benchmarks.kill_matrix [--learner-kills 50] [--sync-kills 20] [--seed 14] [--checkpoint-every 10]
       [--ctrl-c-repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys

from benchmarks.args import chaos_logging, description, non_negative_int, workdir_or_temp
from benchmarks.ctrl_c import ctrl_c_bars, measure_ctrl_c
from benchmarks.fuzz import print_bars
from diloco_async.chaos.kill_matrix import KillMatrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kill_matrix", description=description(__doc__))
    ap.add_argument("--learner-kills", type=int, default=50)
    ap.add_argument("--sync-kills", type=int, default=20)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--checkpoint-every", type=float, default=10.0, help="the synchronizer's checkpoint period (s)")
    ap.add_argument("--ctrl-c-repeats", type=non_negative_int, default=5,
                    help="repeats of the Ctrl-C stops after the kills (benchmarks/ctrl_c.py; 0: none)")
    ap.add_argument("--workdir", default=None, help="store and logs (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    chaos_logging()
    workdir = workdir_or_temp(args.workdir, "bench-kill-")
    try:
        res = KillMatrix(workdir, args.seed, args.learners,
                         checkpoint_every_s=args.checkpoint_every).run(args.learner_kills, args.sync_kills)
        stops = measure_ctrl_c(args.ctrl_c_repeats, workdir / "ctrl-c") if args.ctrl_c_repeats else None
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    merges = ", ".join("none" if t is None else f"{t:.1f}" for t in res.restart_to_merge_s)
    ready = ", ".join(f"{t:.1f}" for t in res.resume_ready_s)
    print(f"\n{res.elapsed_s:.0f} s in all; learner kills {res.learner_kills} ({res.mid_upload_kills} in an upload "
          f"window, {res.mid_upload_confirmed} confirmed: key never published), learner restarts "
          f"{res.learner_restarts}; synchronizer kills {res.sync_kills}, resumes finished {res.resumes_finished}")
    print(f"resume -> listening (s): {ready or '-'} ({res.resume_retries} failed starts tried again)")
    print(f"restart -> first merge (s): {merges or '-'}")
    print(f"merges at the end: {res.merges}; merged contribution objects checked: {res.merged_checked}, incomplete: "
          f"{res.merged_incomplete[:5]}; published versions read back: {res.published_read}")
    for stop in stops.bad_stops if stops else []:
        print(stop)
    rows = res.bars(args.learner_kills, args.sync_kills)
    rows += ctrl_c_bars(stops, args.ctrl_c_repeats) if stops else []
    return 0 if print_bars(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
