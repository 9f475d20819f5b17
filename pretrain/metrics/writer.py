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

from pretrain.distributed.env import unique_suffix


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._jsonl = None
        if enabled:
            self._open(resume_step)

    def _open(self, resume_step: int) -> None:
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

    def rewind(self, step: int) -> None:
        """Continue as a run resumed at ``step`` would (a rollback): records and events of later steps go."""
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
            self._open(step)

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
    tmp = path.with_name(f".{path.name}.tmp-{unique_suffix()}")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


_PROGRESS_TAIL = ("lr", "grad_norm", "loss_scale", "bad_steps", "samples_per_s", "tokens_per_s", "data_wait_frac")
_PROGRESS_HIDDEN = {"step", "split", "time", "tokens_seen"}


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 95 -> '1m35s', 4 -> '4s'."""
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def format_progress(step: int, max_steps: int, scalars: dict[str, float], eta_s: float | None = None) -> str:
    """The console line: the loss, every objective's own figures (in the order they were logged), then lr, grad
    norm, throughput, the data-wait fraction and the time left (a loss scale of 1 and zero bad steps are not
    shown)."""
    parts = [f"step {step}/{max_steps}"]
    if "loss" in scalars:
        parts.append(f"loss {scalars['loss']:.4g}")
    for key, v in scalars.items():
        if key not in _PROGRESS_HIDDEN and key not in _PROGRESS_TAIL and key != "loss":
            parts.append(f"{key} {v:.4g}")
    for key in _PROGRESS_TAIL:
        v = scalars.get(key)
        if v is None or (key == "loss_scale" and v == 1.0) or (key == "bad_steps" and v == 0):
            continue
        if key == "lr":
            parts.append(f"lr {v:.3g}")
        elif key in ("samples_per_s", "tokens_per_s"):
            parts.append(f"{key} {v:,.0f}")
        elif key == "data_wait_frac":
            parts.append(f"data_wait {v:.1%}")
        else:
            parts.append(f"{key} {v:.4g}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def print_progress(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
