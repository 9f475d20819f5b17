"""Stand-in trainer for the Slurm tests: same CLI and signal contract as `pretrain.train`.

    python tests/slurm/payload.py CONFIG run_dir=DIR [steps=N] [step_time=S] [slow_start=S]

Trains a tiny linear model with all-reduced gradients (gloo), appends {"step", "loss"} per step to
RUN_DIR/metrics.jsonl, resumes from RUN_DIR/ckpt.pt, and on SIGUSR1/SIGTERM finishes the current
step, checkpoints and exits with code 3. Records what each rank saw in RUN_DIR/rank{r}-try{k}.json.
slow_start=S: write RUN_DIR/started-rank{r}-try{k} first, then keep the signals as inherited (USR1
ignored under slurm/pretrain.sbatch) for S seconds before installing the handlers, like a trainer
still importing and opening its data.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.distributed.env import (
    destroy_process_group,
    detect_env,
    init_process_group,
)

REQUEUE_EXIT = 3


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x_BD = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y_B = x_BD @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + 0.1 * torch.randn(8, generator=g, dtype=torch.float64)
    return x_BD, y_B


def main(argv: list[str]) -> int:
    usr1_ignored_at_start = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    kv = dict(a.split("=", 1) for a in argv[2:])  # argv[1] is the config
    run_dir, steps, step_time = Path(kv["run_dir"]), int(kv.get("steps", 20)), float(kv.get("step_time", 0.05))
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    env = detect_env()
    if "slow_start" in kv:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"started-rank{env.rank}-try{attempt}").touch()
        time.sleep(float(kv["slow_start"]))
    stop = {"sig": 0}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    init_process_group(env, backend="gloo", timeout_s=60)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {"env": env.__dict__, "usr1_ignored_at_start": usr1_ignored_at_start, "argv": argv,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid(), "ppid": os.getppid()}
    (run_dir / f"rank{env.rank}-try{attempt}.json").write_text(json.dumps(info))

    w_D = torch.zeros(4, dtype=torch.float64)
    start, ckpt = 0, run_dir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt)
        w_D, start = state["w"], state["step"]
    for step in range(start, steps):
        x_BD, y_B = _batch(step, env.rank)
        err_B = x_BD @ w_D - y_B
        stats = torch.cat([(x_BD.T @ err_B) * 2 / len(y_B), (err_B ** 2).mean().reshape(1)])
        dist.all_reduce(stats)
        stats /= env.world_size
        w_D = w_D - 0.05 * stats[:4]
        time.sleep(step_time)
        if env.is_main:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": stats[4].item(), "try": attempt}) + "\n")
        flag = torch.tensor([float(stop["sig"])])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        if flag.item() and step + 1 < steps:
            if env.is_main:
                torch.save({"w": w_D, "step": step + 1}, run_dir / "ckpt.tmp")
                os.replace(run_dir / "ckpt.tmp", ckpt)
                (run_dir / f"preempted-try{attempt}.json").write_text(
                    json.dumps({"step": step + 1, "signal": int(flag.item())}))
            dist.barrier()
            destroy_process_group()
            return REQUEUE_EXIT
    if env.is_main:
        (run_dir / "done.json").write_text(json.dumps({"step": steps, "try": attempt}))
    destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    # Python resets its handlers to the default action while the interpreter shuts down, and the default
    # action of USR1 is to die: a USR1 the batch shell resends meanwhile would turn exit 3 into "killed by
    # signal 10". pretrain.train restores the inherited "ignore" (StopSignal.uninstall); so does the stand-in.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.exit(code)
