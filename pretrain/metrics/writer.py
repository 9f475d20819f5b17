"""Run-directory monitoring: metrics.jsonl, TensorBoard event files, a console progress line.

Only the main rank writes. Every logged step becomes one JSON object in ``metrics.jsonl`` and
the same scalars under ``tb/`` (``train/<name>``, ``valid/<name>``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if resume_step and path.exists():
            _truncate_after_step(path, resume_step)
        self._jsonl = open(path, "a", encoding="utf-8")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events of steps after the checkpoint we resumed from (they will be redone).
        self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, scalars: dict[str, float], *, split: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, "time": round(time.time(), 3)}
        record.update({k: _clean(v) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in scalars.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(f"{split}/{k}", v, step)

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
            self.enabled = False


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep it visible
    return v


def _truncate_after_step(path: Path, step: int) -> None:
    """Drop records of steps > ``step`` (they were logged after the checkpoint we resume from)."""
    keep = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: drop it
            if rec.get("step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


def format_progress(step: int, max_steps: int, scalars: dict[str, float]) -> str:
    parts = [f"step {step}/{max_steps}"]
    for key in ("loss", "mlm", "nt_xent", "mlm_acc", "cl_acc", "lr", "grad_norm", "samples_per_s", "tokens_per_s",
                "data_wait_frac"):
        if key in scalars:
            v = scalars[key]
            parts.append(f"{key} {v:.3g}" if key in ("lr",) else f"{key} {v:.4g}")
    return " | ".join(parts)


def print_progress(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
