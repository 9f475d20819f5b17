"""Chaos soak (issue 25 item 5): a 2-node torchrun training on this machine hit, on a seeded schedule, by SIGKILLed
ranks, SIGTERM/SIGUSR1, a truncated or bit-flipped newest checkpoint, a full disk and a killed node, relaunched
(requeued) after every stop until it completes; then its per-step losses are compared bitwise with an uninterrupted
run, every checkpoint seen complete is accounted for, and the faults are printed as a table (and --json-out).

    python tools/chaos_soak.py --work /tmp/soak --minutes 20 --seed 1 --max-steps 2000
    python tools/chaos_soak.py --work /tmp/soak --minutes 1 -- model.hidden_size=64   # extra trainer overrides

    python tools/chaos_soak.py --work /tmp/soak --minutes 8 --seed 3 --slurm   # on the netns Slurm cluster

--slurm: every launch is an attempt of one `sbatch slurm/pretrain.sbatch` job (2 nodes x 1 worker) on a 3-node
Slurm cluster in network namespaces that the soak starts and stops (tests/slurm/netns.py of this checkout, loaded
from tests/; needs root and slurm-wlm + munge, installed if missing). Needs root for the tmpfs that disk_full fills
(else that fault is listed as not injected). Exit 0 when every fault had the expected outcome, no checkpoint was
lost and the losses are bitwise equal; 1 otherwise; 2 when the Slurm cluster cannot run here.
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
    p.add_argument("--slurm", action="store_true", help="launch as sbatch jobs on the netns Slurm cluster")
    p.add_argument("overrides", nargs="*", help="extra trainer overrides after --, applied to the tiny config")
    args = p.parse_args(argv)

    from pretrain.training.chaos import fault_table, write_report
    from pretrain.training.chaos_slurm import build_cluster, load_netns, remove_cluster
    from pretrain.training.chaos_soak import SoakConfig, run_soak, tiny_setup

    ClusterError = load_netns().ClusterError

    work = Path(args.work)
    overrides = tiny_setup(work / "corpus") + args.overrides
    cfg = SoakConfig(work_dir=work, overrides=overrides, max_steps=args.max_steps, ckpt_every=args.every,
                     keep_last=args.keep_last, seed=args.seed, minutes=args.minutes, timeout_s=args.timeout_s,
                     reference=Path(args.reference) if args.reference else None,
                     launcher="slurm" if args.slurm else "torchrun")
    load = os.getloadavg()
    cluster = build_cluster(cfg.nodes) if args.slurm else None
    try:
        result = run_soak(cfg, cluster=cluster)
    except ClusterError as e:  # NetnsUnavailable, SlurmUnavailable: this machine cannot run the cluster
        print(f"chaos: the Slurm cluster cannot run here: {e}", file=sys.stderr)
        return 2
    finally:
        if cluster is not None:
            remove_cluster(cluster, work / "slurm-logs")
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
