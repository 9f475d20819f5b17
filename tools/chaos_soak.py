"""Chaos soak (issue 25 item 5): a 2-node torchrun training on this machine hit, on a seeded schedule, by SIGKILLed
ranks, SIGTERM/SIGUSR1, a truncated or bit-flipped newest checkpoint, a full disk and a killed node, relaunched
(requeued) after every stop until it completes; then its per-step losses are compared bitwise with an uninterrupted
run, every checkpoint seen complete is accounted for, and the faults are printed as a table (and --json-out).

    python tools/chaos_soak.py --work /tmp/soak --minutes 20 --seed 1 --max-steps 2000
    python tools/chaos_soak.py --work /tmp/soak --minutes 1 -- model.hidden_size=64   # extra trainer overrides

Needs root for the tmpfs that disk_full fills (else that fault is listed as not injected). Exit 0 when every
fault had the expected outcome, no checkpoint was lost and the losses are bitwise equal; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pretrain, not an installed one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="work directory: logs, run_fs/ (tmpfs), ref/, soak.json")
    p.add_argument("--minutes", type=float, default=1.0, help="draw faults for this long (at least one of each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--timeout-s", type=int, default=20, help="distributed.timeout_s of the trainer")
    p.add_argument("--reference", help="a finished uninterrupted run of the same config (else one is run)")
    p.add_argument("--json-out", help="the table and summary as JSON (default WORK/soak.json)")
    p.add_argument("overrides", nargs="*", help="extra trainer overrides after --, applied to the tiny config")
    args = p.parse_args(argv)

    from pretrain.training.chaos import fault_table, write_report
    from pretrain.training.chaos_soak import SoakConfig, run_soak, tiny_setup

    work = Path(args.work)
    overrides = tiny_setup(work / "corpus") + args.overrides
    cfg = SoakConfig(work_dir=work, overrides=overrides, max_steps=args.max_steps, ckpt_every=args.every,
                     keep_last=args.keep_last, seed=args.seed, minutes=args.minutes, timeout_s=args.timeout_s,
                     reference=Path(args.reference) if args.reference else None)
    load = os.getloadavg()
    result = run_soak(cfg)
    result.summary["loadavg_start"] = [round(x, 2) for x in load]
    result.summary["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    for line in fault_table(result.faults):
        print(line)
    print(json.dumps(result.summary, indent=1))
    write_report(Path(args.json_out or work / "soak.json"), result.faults, result.summary)
    for problem in result.problems:
        print(f"chaos: PROBLEM: {problem}", file=sys.stderr)
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
