"""Stand-in trainer for the multi-node sbatch test of a stop that srun reports as a failure.

    python tests/slurm/uneven_stop.py CONFIG run_dir=DIR

Node 0's worker does what the trainer does once its stop checkpoint is published: it writes the stop record
(``pretrain.training.stop_record``, this launch's job id and restart count) and exits 75 at once. The other
nodes' workers sleep, as a slower node still leaving would, so that ``srun --kill-on-bad-exit`` SIGTERMs them
and the step's exit code is not 75.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pretrain.training.stop_record import write_stop_record


def main(argv: list[str]) -> int:
    kv = dict(a.split("=", 1) for a in argv[2:])  # argv[1] is the config
    run_dir = Path(kv["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("SLURM_NODEID") == "0":
        write_stop_record(run_dir, code=75, step=1, checkpoint=str(run_dir / "checkpoints" / "step_00000001"))
        return 75
    time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
