"""Directories and lines published whole: ``replace_dir`` (best/, a checkpoint tag, an export, a dataset) never
leaves the name absent, even when a rename fails between its steps; ``recover_dir`` undoes a swap cut by a kill;
metrics.jsonl keeps whole lines when the disk fills mid-line."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain import fsutil as files
from pretrain.export.resolve import best_record, open_weights, select_checkpoint
from pretrain.fsutil import recover_dir, replace_dir
from pretrain.metrics.writer import MetricsWriteError, MetricsWriter
from pretrain.training.evaluation import StsbKeepBest


def _dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "a.txt").write_text(text)
    (path / "b.txt").write_text(text)
    return path


def _siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p != target)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_dir_puts_the_new_directory_in_place_and_leaves_nothing_beside(exchange, tmp_path, monkeypatch):
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target = _dir(tmp_path / "best", "old")
    replace_dir(_dir(tmp_path / ".best.tmp-1", "new"), target)
    assert (target / "a.txt").read_text() == "new" and (target / "b.txt").read_text() == "new"
    assert _siblings(target) == []
    replace_dir(_dir(tmp_path / ".fresh.tmp-1", "first"), tmp_path / "fresh")  # no old one: one rename
    assert (tmp_path / "fresh" / "a.txt").read_text() == "first"


def test_a_failure_between_the_two_renames_puts_the_old_directory_back(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target = _dir(tmp_path / "best", "old")
    new = _dir(tmp_path / ".best.tmp-1", "new")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # the new directory's rename into place
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        replace_dir(new, target)
    monkeypatch.setattr(os, "replace", real)
    assert calls[0][0] == "best" and calls[0][1].startswith(".best.old-")
    assert (target / "a.txt").read_text() == "old" and (target / "b.txt").read_text() == "old"
    assert _siblings(target) == [".best.tmp-1"]  # the caller's own temporary directory, which it removes


def test_recover_dir_restores_a_swap_cut_by_a_kill_and_removes_leftovers(tmp_path):
    _dir(tmp_path / ".best.old-hostA-12-ab", "old")  # killed after the old one was renamed away
    _dir(tmp_path / ".best.tmp-xyz", "half")  # the new one, never renamed in
    recover_dir(tmp_path / "best")
    assert (tmp_path / "best" / "a.txt").read_text() == "old" and _siblings(tmp_path / "best") == []
    _dir(tmp_path / ".best.old-hostA-13-cd", "older")  # killed before the trash was removed: best/ is the new one
    recover_dir(tmp_path / "best")
    assert (tmp_path / "best" / "a.txt").read_text() == "old" and _siblings(tmp_path / "best") == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_best_dir_failing_mid_swap_keeps_the_old_best_whole_and_readable(exchange, tiny_encoder, tmp_path,
                                                                      monkeypatch):
    model, tok = tiny_encoder
    keeper = SimpleNamespace(run_dir=tmp_path, tokenizer_path=tok, pooling="mean")
    StsbKeepBest._write_best(keeper, model, 100, 0.5, "seed: 1\n")
    assert best_record(tmp_path) == {"step": 100, "stsb_dev_spearman": 0.5, "pooling": "mean"}

    def fail(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if exchange:
        monkeypatch.setattr(files, "_exchange", fail)
    else:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        real = os.replace

        def replace(src, dst):  # the new best/'s rename into place fails, the old one already renamed away
            if Path(dst).name == "best" and Path(src).name.startswith(".best.tmp-"):
                fail()
            return real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        StsbKeepBest._write_best(keeper, model, 200, 0.7, "seed: 1\n")
    monkeypatch.undo()
    assert best_record(tmp_path)["step"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"], "a stray directory was left beside best/"
    assert open_weights(tmp_path / "best").model_cfg.hidden_size == 32
    path, line = select_checkpoint(tmp_path, "best")
    assert path == tmp_path / "best" and "step 100" in line
    StsbKeepBest._write_best(keeper, model, 200, 0.7, "seed: 2\n")
    assert best_record(tmp_path)["step"] == 200 and (tmp_path / "best" / "run_config.yaml").read_text() == "seed: 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_metrics_line_cut_by_a_full_disk_is_truncated_and_writing_stops(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path)
    writer.log(1, {"loss": 1.0})
    real = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[:10]))  # part of the line fits
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "write", write)
        writer.log(2, {"loss": 0.9})
    assert writer.failure == f"writing {tmp_path / 'metrics.jsonl'} failed (ENOSPC: No space left on device)"
    writer.log(3, {"loss": 0.8})  # stopped: nothing more is written
    writer.rewind(1)
    writer.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [1]


def test_a_run_directory_still_full_at_start_is_one_clear_error(tmp_path, monkeypatch):
    """The records after the checkpoint are cut in place (no copy: that works on a full disk); a file that cannot
    be opened for the run's records is one clear error."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "split": "train"}\n{"step": 2, "split": "train"}\n')

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(MetricsWriteError, match=rf"writing {tmp_path / 'metrics.jsonl'} failed \(ENOSPC: No space "
                                                rf"left on device\); free space in {tmp_path} and relaunch"):
        MetricsWriter(tmp_path, resume_step=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no partial copy left beside it
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "split": "train"}\n'


def test_a_tensorboard_threads_failed_write_is_one_line_and_other_threads_keep_their_hook(tmp_path, monkeypatch,
                                                                                            capsys):
    """TensorBoard's event-writer thread re-raises a failed write out of its ``run`` (Python would print a
    traceback mid-run): one warning line instead; another thread's exception reaches the hook that was there."""
    import queue
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    writer = MetricsWriter(tmp_path)
    writer.log(1, {"loss": 1.0})

    class Full(_AsyncWriterThread):  # TensorBoard's own thread class, its write failing as on a full disk
        def _run(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class Other(threading.Thread):
        def run(self):
            raise OSError(errno.EIO, "another thread's error")

    for thread in (Full(queue.Queue(), None, 0), Other()):
        thread.start()
        thread.join()
    writer.close()
    assert [type(e.thread) for e in seen] == [Other], seen
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"warning: TensorBoard's event writer stopped: writing {tmp_path / 'tb'} failed (ENOSPC" in err
