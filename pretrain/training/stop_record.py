"""``<run_dir>/stop.json``: the trainer's own word that this launch stopped on a signal after a complete checkpoint.

Rank 0 writes it (atomically) once the stop checkpoint is published, naming the job and its restart count. A
launcher that sees another exit code than the trainer's reads it back: under Slurm, ``srun --kill-on-bad-exit``
answers the first node's exit 75 by SIGTERMing the other node's task, which has already written its share of the
checkpoint, and the step's code becomes 143. ``python -m pretrain.training.stop_record RUN_DIR`` prints the
recorded code and exits 0 when the record is this launch's (the same job id and ``SLURM_RESTART_COUNT``), else
exits 1 and prints nothing. ``python -m pretrain.training.stop_record --requeue RUN_DIR --max-stalled N``: whether
the batch script should requeue itself (``requeue_allowed``: not when the latest checkpoint did not move over the
last N requeues). This module imports nothing heavy: the batch script runs it after every step.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from pretrain.checkpoint.files import atomic_write_text
from pretrain.distributed.env import job_id

STOP_RECORD = "stop.json"


def launch_id(environ=os.environ) -> dict:
    """What tells this launch from an earlier one of the same run: the job (``job_id``) and, under Slurm, the
    restart count a requeue increments."""
    return {"job": job_id(environ), "restart": int(environ.get("SLURM_RESTART_COUNT") or 0)}


def write_stop_record(run_dir: str | os.PathLike, *, code: int, step: int, checkpoint: str,
                      environ=os.environ) -> None:
    """Record that this launch stopped with ``code`` after publishing ``checkpoint`` (step ``step``)."""
    record = {**launch_id(environ), "code": int(code), "step": int(step), "checkpoint": str(checkpoint),
              "time": time.time()}
    atomic_write_text(Path(run_dir) / STOP_RECORD, json.dumps(record, indent=1) + "\n")


def recorded_code(run_dir: str | os.PathLike, environ=os.environ) -> int | None:
    """The exit code this launch recorded in ``run_dir`` (None: no record, an unreadable one, another launch's, or
    one written outside any job, where launches cannot be told apart)."""
    try:
        record = json.loads((Path(run_dir) / STOP_RECORD).read_text(encoding="utf-8"))
        code = record["code"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    me = launch_id(environ)
    if not me["job"] or record.get("job") != me["job"] or record.get("restart") != me["restart"]:
        return None
    return code if isinstance(code, int) else None


REQUEUES = "requeues.jsonl"
"""``<run_dir>/requeues.jsonl``: one line per self-requeue of the batch script ({job, restart, step, time})."""

_LATEST_TAG = re.compile(r"step_(\d+)")


def _latest_step(run_dir: Path) -> int:
    """The step of the run's ``checkpoints/latest`` (read as text: nothing heavy imported); -1 without one."""
    try:
        m = _LATEST_TAG.fullmatch((run_dir / "checkpoints" / "latest").read_text(encoding="utf-8").strip())
    except OSError:
        return -1
    return int(m.group(1)) if m else -1


def requeue_allowed(run_dir: str | os.PathLike, *, max_stalled: int, environ=os.environ) -> tuple[bool, str]:
    """Whether the batch script should requeue this launch, recorded in ``requeues.jsonl``: yes unless the run's
    latest checkpoint did not move over the last ``max_stalled`` requeues of this job (a job that keeps being
    stopped before it checkpoints anything new, e.g. a time limit shorter than its start-up); (answer, why)."""
    run_dir = Path(run_dir)
    me, step = launch_id(environ), _latest_step(run_dir)
    path = run_dir / REQUEUES
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        text = ""
    lines = text.splitlines()
    history = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(rec, dict) and rec.get("job") == me["job"]:
            history.append(rec)
    history.append({**me, "step": step, "time": time.time()})
    torn = bool(text) and not text.endswith("\n")  # a line cut by a kill: start a new one
    with open(path, "a", encoding="utf-8") as f:
        f.write(("\n" if torn else "") + json.dumps(history[-1]) + "\n")
    # N requeues that moved nothing: N + 1 records of one step (the one before them is where it stood)
    last = history[-(max_stalled + 1):]
    if max_stalled > 0 and len(last) == max_stalled + 1 and len({r.get("step") for r in last}) == 1:
        return False, (f"the run's latest checkpoint (step {step}) did not move over the last {max_stalled} requeues "
                       f"of job {me['job']} ({path}): look at the job's output for why it stops before checkpointing")
    return True, f"latest checkpoint step {step}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4 and argv[0] == "--requeue" and argv[2] == "--max-stalled":
        ok, why = requeue_allowed(argv[1], max_stalled=int(argv[3]))
        print(why)
        return 0 if ok else 1
    if len(argv) != 1:
        print("usage: python -m pretrain.training.stop_record RUN_DIR\n"
              "       python -m pretrain.training.stop_record --requeue RUN_DIR --max-stalled N", file=sys.stderr)
        return 2
    code = recorded_code(argv[0])
    if code is None:
        return 1
    print(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
