"""Run-directory monitoring: metrics.jsonl, TensorBoard event files, a console progress line.

Only the main rank writes. Every record becomes one JSON object in ``metrics.jsonl`` and its numbers the same
scalars under ``tb/`` (tag ``<split>/<name>``: ``train/loss``, ``valid/mlm``, ``eval/stsb_dev_spearman``,
``checkpoint/pause_s``, ``rollback/retry``), non-finite ones included (a string in JSON, NaN or inf in TensorBoard);
docs/architecture.md lists them all. A write that fails (disk full, quota, I/O error) stops all writing and leaves
``failure`` set; the trainer then checkpoints and stops (exit 4).
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import threading
import time
from pathlib import Path


class MetricsWriteError(RuntimeError):
    """metrics.jsonl or the TensorBoard events could not be written; the message says what to do."""


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.failure: str | None = None
        """'writing <file> failed (<error>)' once a write failed; nothing is written after it."""
        self._tb = None
        self._fd = None
        if enabled:
            try:
                self._open(resume_step)
            except OSError as e:  # a run directory that is still full when the run starts (or resumes)
                where = Path(e.filename) if e.filename else self.run_dir / "metrics.jsonl"
                raise MetricsWriteError(f"{_failed(where, e)}; free space in {self.run_dir} and relaunch: it "
                                        f"resumes from the last checkpoint") from None

    def _open(self, resume_step: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            # At step 0 the run starts (over): an earlier launch that never checkpointed left records of steps that
            # are all redone, its step-0 validation included.
            _truncate_after_step(path, resume_step if resume_step else -1)
        # Unbuffered appends: each line is one os.write whose failure is undone by ftruncate (see _append).
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        from torch.utils.tensorboard import SummaryWriter

        _event_writer_failures_in_one_line(self.run_dir / "tb")
        _after_existing_event_files(self.run_dir / "tb")
        # purge_step drops events of steps after the checkpoint we resumed from (they will be redone); at a start,
        # every earlier event (step >= 0).
        self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step + 1 if resume_step else 0)

    def log(self, step: int, scalars: dict[str, float], *, split: str = "train") -> None:
        if not self.enabled or self.failure:
            return
        record = {"step": step, "split": split, "time": round(time.time(), 3)}
        record.update({k: _clean(v) for k, v in scalars.items()})
        try:
            self._append((json.dumps(record) + "\n").encode("utf-8"))
        except OSError as e:
            self._fail(self.run_dir / "metrics.jsonl", e)
            return
        try:
            for k, v in scalars.items():  # NaN and inf too (TensorBoard marks them): the same points as the record
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, step)
        except OSError as e:  # raised by the event writer's thread, on the next call after its write failed
            self._fail(self.run_dir / "tb", e)

    def _append(self, line: bytes) -> None:
        """One whole line or none: a write cut short (a full disk mid-line) is truncated back to the last line."""
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass  # then the cut line is dropped when the run resumes (_truncate_after_step)
            raise

    def _fail(self, path: Path, e: OSError) -> None:
        self.failure = _failed(path, e)
        self._close_files()

    def rewind(self, step: int) -> None:
        """Continue as a run resumed at ``step`` would (a rollback): records and events of later steps go."""
        if self.enabled and not self.failure:
            self._close_files()
            try:
                self._open(step)
            except OSError as e:
                self._fail(self.run_dir / "metrics.jsonl", e)

    def flush(self) -> None:
        if self.enabled and not self.failure:
            try:
                self._tb.flush()
            except OSError as e:
                self._fail(self.run_dir / "tb", e)

    def close(self) -> None:
        if self.enabled:
            self._close_files()
            self.enabled = False

    def _close_files(self) -> None:
        """Close both files; a failing flush of pending TensorBoard events (a full disk) is not raised again."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:
                pass
            self._tb = None


def _event_writer_failures_in_one_line(tb_dir: Path) -> None:
    """TensorBoard's event-writer thread re-raises a failed write (a full disk) out of its ``run``, and Python
    prints that as "Exception in thread Thread-N" with a traceback in the middle of the run's output, although the
    writer's next ``add_scalar`` raises it again here and the trainer says what happened and what to do (exit 4).
    Such an OSError from a TensorBoard thread becomes one line on stderr; any other thread's exception goes to the
    hook that was there before (chained, installed once)."""
    previous = threading.excepthook
    if getattr(previous, "event_writer_failures", False):
        return

    def hook(args) -> None:
        if issubclass(args.exc_type, OSError) and any(c.__module__.startswith("tensorboard.")
                                                      for c in type(args.thread).__mro__):
            print(f"warning: TensorBoard's event writer stopped: {_failed(tb_dir, args.exc_value)}", file=sys.stderr,
                  flush=True)
            return
        previous(args)

    hook.event_writer_failures = True
    threading.excepthook = hook


def _after_existing_event_files(tb_dir: Path) -> None:
    """Wait, when needed, until a new event file's name sorts after every one in ``tb_dir``. TensorBoard reads a
    directory's event files in name order and applies a purge (a resume's, a rollback's) to what it read before;
    the name is ``events.out.tfevents.<whole seconds>.<host>.<pid>.<counter>``, so a file opened in the same second
    as an earlier one can sort before it (counter 10 before 9; another process's pid), and then the earlier file's
    events of the redone steps come back after the purge. Only a launch or rollback within a second of the previous
    writer waits (a second at most; a file stamped further ahead, by another host's clock, is not waited for)."""
    if not tb_dir.is_dir():
        return
    stamps = [int(parts[3]) for parts in (f.name.split(".") for f in tb_dir.glob("events.out.tfevents.*"))
              if len(parts) > 3 and parts[3].isdigit()]
    wait = max(stamps) + 1 - time.time() if stamps else 0.0
    if 0 < wait <= 2:
        time.sleep(wait + 0.01)


def _failed(path: Path, e: OSError) -> str:
    return f"writing {path} failed ({errno.errorcode.get(e.errno, type(e).__name__)}: {e.strerror or e})"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep it visible
    return v


NUMBER_WORDS = ("nan", "inf", "-inf", "infinity", "-infinity")
"""Text that ``read_number`` reads back as a float (any case)."""


def read_number(v):
    """A value as metrics.jsonl stores it, back: the strings the writer puts for non-finite floats ("nan", "inf",
    "-inf") as those floats; anything else as it is."""
    if isinstance(v, str) and v.lower() in NUMBER_WORDS:
        return float(v)
    return v


def _truncate_after_step(path: Path, step: int) -> None:
    """Drop the records of steps > ``step`` (logged after the checkpoint we resume from; -1: all of them) and a
    line cut by a kill. Records are appended in step order (every launch and rollback cuts the file here before it
    appends), so the file is read backwards only as far as its last whole record of a step <= ``step`` and cut there
    in place: a resume or rollback costs the records since the checkpoint, not the run's whole history, and needs
    no free space. (Until 2026-12-07 every launch and rollback parsed and rewrote the whole file: ~100k records
    and tens of MB at step 1e6.)"""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        keep = _end_of_records_upto(f, end, step) if step >= 0 else 0
        if keep < end:
            f.truncate(keep)
            os.fsync(f.fileno())


def _end_of_records_upto(f, end: int, step: int) -> int:
    """The offset just past the last whole line of ``f`` (its first ``end`` bytes) that is a record of a step <=
    ``step``; 0 when there is none."""
    for start, line in _lines_backwards(f, end):
        if line.endswith(b"\n"):
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by a kill (no JSON, or not UTF-8): dropped
                continue
            if isinstance(rec, dict) and rec.get("step", 0) <= step:
                return start + len(line)
    return 0


TAIL_BLOCK = 1 << 16
"""Bytes read at a time by ``_lines_backwards``."""


def _lines_backwards(f, end: int):
    """(offset, bytes with its newline) of each line of ``f``'s first ``end`` bytes, the last line first, read from the
    end in blocks of TAIL_BLOCK (memory: a block and one line)."""
    pos, head = end, b""  # head: the start of a line that began in an earlier block
    while pos > 0:
        start = max(0, pos - TAIL_BLOCK)
        f.seek(start)
        block = f.read(pos - start) + head
        pos, cut = start, len(block)  # cut: the end of the line being looked for, in block
        while (i := block.rfind(b"\n", 0, max(0, cut - 1))) >= 0:  # its own newline at cut - 1 is not its start
            yield start + i + 1, block[i + 1:cut]
            cut = i + 1
        head = block[:cut]
    if head:
        yield 0, head


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
