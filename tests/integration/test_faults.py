"""The fault suite of the operations issue: each fault injected on a tiny run, with its expected outcome.

In-process runs (``pretrain.train.main`` / ``Trainer`` in one process) where they can be; the two faults
that need real processes (a rank SIGKILLed mid-step, a SIGKILL during a checkpoint save) run subprocesses.
The observed outcomes are tabulated in docs/operations.md.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import pretrain.objective as objective_mod
from pretrain.checkpoint import store
from pretrain.checkpoint.universal import UNIVERSAL_SOURCE
from pretrain.data.shards import ShardedDataset, verify_dataset

REPO = Path(__file__).resolve().parents[2]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------------------------- helpers

def _main(argv: list[str], capsys) -> tuple[int, str]:
    from pretrain.train import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def _poison_mlm(monkeypatch, bad_calls: set[int], kind: str) -> list[int]:
    """Make the MLM term's loss (kind='loss') or its gradient (kind='grad') NaN on the given 1-based calls."""
    orig = objective_mod.OBJECTIVES["mlm"]
    calls = [0]

    def term(fwd, cfg, ctx):
        loss, count, metrics = orig(fwd, cfg, ctx)
        calls[0] += 1
        if calls[0] in bad_calls:
            if kind == "loss":
                loss = loss * float("nan")
            else:
                loss = loss + 0.0
                loss.register_hook(lambda g: g * float("nan"))
        return loss, count, metrics

    monkeypatch.setitem(objective_mod.OBJECTIVES, "mlm", term)
    return calls


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == "train"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    for k in _LAUNCH_VARS:
        env.pop(k, None)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_dataset(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------ NaN / inf loss or gradient

@pytest.mark.parametrize("zero_stage, precision", [(0, "fp32"), (2, "fp32"), (2, "bf16"), (0, "bf16")])
def test_nan_loss_or_gradient_step_is_skipped_parameters_unchanged(zero_stage, precision, tmp_path, tiny_overrides,
                                                                   clean_env, monkeypatch):
    """The Engine decides on the device (fp32 at ZeRO 0-2, bf16 at ZeRO 2) or DeepSpeed does (bf16 at ZeRO-0)."""
    from pretrain.config import load_run_config
    from pretrain.distributed.env import (
        destroy_process_group,
        init_process_group,
        single_process_env,
    )
    from pretrain.training.trainer import Trainer

    _poison_mlm(monkeypatch, {2}, "loss")  # step 2: NaN loss; step 3: finite loss, NaN gradients
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]",
                                               distributed__zero_stage=zero_stage, train__precision=precision))
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    try:
        trainer = Trainer(cfg, env)
        loader = iter(trainer._loader(trainer.train_set, 0))
        trainer.engine.train()
        flags = []
        for step in range(1, 5):
            before = [p.detach().clone() for p in trainer.module.parameters()]
            opt_before, lr_before = _optimizer_snapshot(trainer.engine), _schedule_snapshot(trainer.engine)
            _, bad = _step_with_grad_poison(trainer, loader, step == 3)
            bad = bool(bad)  # a device tensor where the Engine decided
            after = [p.detach().clone() for p in trainer.module.parameters()]
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            assert all(torch.isfinite(a).all() for a in after), f"step {step} wrote non-finite parameters"
            if bad:  # a skipped step leaves AdamW's moments, its step count and the LR schedule untouched too
                assert _same_optimizer_state(opt_before, _optimizer_snapshot(trainer.engine)), f"step {step}"
                assert _schedule_snapshot(trainer.engine) == lr_before, f"step {step} moved the LR schedule"
            else:
                assert _schedule_snapshot(trainer.engine) != lr_before, f"step {step} did not advance the schedule"
            flags.append((bad, unchanged))
        assert flags == [(False, False), (True, True), (True, True), (False, False)]
    finally:
        destroy_process_group()


def _optimizer_snapshot(engine) -> list[dict]:
    """AdamW's per-parameter state (exp_avg, exp_avg_sq, step), cloned; under ZeRO its fp32 partitions'."""
    opt = engine.ds.optimizer  # DeepSpeed's wrapper (ZeRO, bf16, fp16) around our AdamW, or AdamW itself
    while not isinstance(opt, torch.optim.AdamW):
        opt = opt.optimizer
    return [{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()} for st in opt.state.values()]


def _same_optimizer_state(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b))


def _schedule_snapshot(engine) -> tuple:
    """(updates applied, the next update's learning rate): the schedule runs on the optimizer's own count."""
    return float(engine._adamw.applied_steps()), float(engine._adamw.current_lr())


def _step_with_grad_poison(trainer, loader, poison: bool):
    """One train_step; with ``poison`` every gradient reaching the parameters is NaN (the loss stays finite)."""
    handles = []
    if poison:
        handles = [p.register_hook(lambda g: g * float("nan")) for p in trainer.module.parameters()
                   if p.requires_grad]
    try:
        return trainer.train_step(loader)
    finally:
        for h in handles:
            h.remove()


def test_consecutive_nan_steps_stop_run_with_last_good_checkpoint(tmp_path, tiny_overrides, clean_env,
                                                                  monkeypatch, capsys):
    run_dir = tmp_path / "nan"
    _poison_mlm(monkeypatch, {3, 5, 6, 7}, "loss")  # one isolated bad step, then 3 in a row
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=12, train__max_bad_steps=3,
                                     checkpoint__every=2), capsys)
    assert code == 3, out[-2000:]
    assert "3 consecutive steps with a non-finite loss" in out and "last at step 7" in out
    assert "last good checkpoint is step_00000006" in out
    recs = {r["step"]: r for r in _train_records(run_dir)}
    assert [recs[s]["bad_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 3]
    ckpt = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpt) == "step_00000006"
    state, _ = store.load_model_state(ckpt / "step_00000006")
    prev, _ = store.load_model_state(ckpt / "step_00000004")
    assert all(torch.isfinite(v).all() for v in state.values())
    # steps 5 and 6 were skipped: the step-6 checkpoint holds the step-4 weights exactly
    assert all(torch.equal(state[k], prev[k]) for k in state)


# -------------------------------------------------------------------------------------------- disk full

def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_disk_full_during_checkpoint_is_clear_error_previous_intact(tmp_path, tiny_overrides, clean_env,
                                                                   monkeypatch, capsys):
    mnt = tmp_path / "small"
    mounted = _mount_tmpfs(mnt, "2560k")  # one tiny checkpoint is ~1.5 MB: the second does not fit
    if not mounted:  # no tmpfs: the same OSError from torch.save
        real_save = torch.save

        def full(obj, f, *a, **k):
            if "step_00000004" in str(f):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", full)
    try:
        run_dir = mnt / "run"
        code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=6, checkpoint__every=2),
                          capsys)
        assert code == 4, out[-2000:]
        assert "no space left on device" in out.lower() and "saving checkpoint step_00000004 failed" in out
        assert "previous checkpoint (step_00000002) is intact" in out
        ckpt = store.checkpoints_dir(run_dir)
        assert store.find_latest(ckpt) == "step_00000002"
        assert not any(p.name.startswith(".tmp-") for p in ckpt.iterdir()), "partial files left behind"
        state, _ = store.load_model_state(ckpt / "step_00000002")
        assert state and all(torch.isfinite(v).all() for v in state.values())
    finally:
        if mounted:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Take the last free byte of ``path``'s filesystem: zeros appended until ENOSPC, in ever smaller writes."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while f.write(bytes(size)):
                    pass
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise


def test_disk_full_while_writing_metrics_checkpoints_exits_4_and_resume_continues(tmp_path, tiny_overrides, clean_env,
                                                                                 monkeypatch, capsys):
    """The run directory's filesystem fills up at step 3 (its checkpoints are on another one): the next write of
    metrics.jsonl or of TensorBoard's events that needs a new page fails, no half line stays, the run checkpoints
    that step and exits 4 with one line saying what to do, and resumes from there once space is freed. (When the
    checkpoint cannot be written either, it is the checkpoint's own exit 4 above.)"""
    from pretrain.metrics.writer import MetricsWriter

    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "4m"):
        pytest.skip("a full filesystem needs a tmpfs mount (root and mount(8)); not available here")
    try:
        run_dir, filler = mnt / "run", mnt / "filler"
        run_dir.mkdir()
        (tmp_path / "ckpts").mkdir()
        ckpt = store.checkpoints_dir(run_dir)
        ckpt.symlink_to(tmp_path / "ckpts")
        log = MetricsWriter.log

        def fill_then_log(self, step, scalars, *, split="train"):
            if step == 3 and not filler.exists():
                _fill(filler)
            return log(self, step, scalars, split=split)

        monkeypatch.setattr(MetricsWriter, "log", fill_then_log)
        thread_errors = []  # what would print "Exception in thread ..." with a traceback
        monkeypatch.setattr(threading, "excepthook", thread_errors.append)
        overrides = tiny_overrides(run_dir, data__valid="[]", train__max_steps=30, checkpoint__every=100)
        code, out = _main(overrides, capsys)
        assert code == 4, out[-2000:]
        assert not thread_errors, [(e.thread, e.exc_value) for e in thread_errors]
        said = re.search(rf"pretrain-train: error \(rank 0\): writing {re.escape(str(run_dir))}/(metrics\.jsonl|tb) "
                         r"failed \(ENOSPC: No space left on device\); checkpointed step (\d+) \((.*?)\)\. Free "
                         rf"space in {re.escape(str(run_dir))} and resume with the same command: it continues from "
                         r"that checkpoint", out)
        assert said, out[-2000:]
        step = int(said.group(2))
        assert 3 <= step < 30 and said.group(3) == str(ckpt / store.tag_for_step(step))
        assert store.find_latest(ckpt) == store.tag_for_step(step) and out.count(f"checkpoint {said.group(3)}") == 1
        text = (run_dir / "metrics.jsonl").read_text()
        logged = [r["step"] for r in _train_records(run_dir)]  # every line parses: none was left half-written
        assert text.endswith("\n") and logged == list(range(1, len(logged) + 1)) and len(logged) <= step

        filler.unlink()  # space freed: the same command resumes from that checkpoint
        monkeypatch.setattr(MetricsWriter, "log", log)
        code, out = _main(overrides, capsys)
        assert code == 0, out[-2000:]
        assert [r["step"] for r in _train_records(run_dir)] == logged + list(range(step + 1, 31))
        assert store.find_latest(ckpt) == "step_00000030"
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_every_checkpoint_file_is_fsynced_before_the_publish_rename(tmp_path, tiny_overrides, clean_env,
                                                                    monkeypatch, capsys):
    import pretrain.checkpoint.files as files_mod

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(files_mod.os, "fsync", fsync)
    monkeypatch.setattr(store.os, "replace", replace)
    run_dir = tmp_path / "run"
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=2, checkpoint__every=0), capsys)
    assert code == 0, out[-2000:]
    tag_dir = store.checkpoints_dir(run_dir) / "step_00000002"
    publish = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tag_dir))
    synced = {Path(e[1]).name for e in events[:publish] if e[0] == "fsync" and ".tmp-step_00000002" in e[1]}
    synced |= {n[1:].split(".tmp-")[0] for n in synced if n.startswith(".")}  # atomic_write_text's temporary name
    written = {p.name for p in tag_dir.rglob("*") if p.is_file()}
    assert written and written <= synced, f"not fsynced before the rename: {written - synced}"


# --------------------------------------------------------------------------------------- killed during save

_SLOW_SAVE = """
import os, sys, time, shutil
import pretrain.checkpoint.store as store
real = shutil.copyfile
def slow(src, dst, *a, **k):
    if "step_00000004" in str(dst):
        open(os.environ["SAVE_MARKER"], "w").close()
        time.sleep(600)
    return real(src, dst, *a, **k)
store.shutil.copyfile = slow
from pretrain.train import cli  # the trainer's own exit: flushed, no interpreter teardown
cli()
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_save_keeps_previous_and_resumes(tmp_path, tiny_overrides, clean_env, capsys):
    run_dir = tmp_path / "run"
    marker = tmp_path / "saving"
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=6, checkpoint__every=2)
    p = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, *args], cwd=REPO, env=dict(_env(), SAVE_MARKER=str(marker)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not marker.exists():
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.time() < deadline, "the step-4 save never started"
        time.sleep(0.2)
    ckpt = store.checkpoints_dir(run_dir)
    assert (ckpt / ".tmp-step_00000004").is_dir()  # killed with the partial tag on disk
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert store.find_latest(ckpt) == "step_00000002"
    # A crash can also leave a published-looking tag without trainer_state.json: never taken for a checkpoint.
    (ckpt / "step_00000006").mkdir()
    (ckpt / "step_00000006" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    assert store.find_latest(ckpt) == "step_00000002"

    code, out = _main(args, capsys)
    assert code == 0, out[-2000:]
    assert f"resumed from {ckpt / 'step_00000002'} at step 2" in out
    assert store.find_latest(ckpt) == "step_00000006"
    assert sorted(q.name for q in ckpt.iterdir() if q.name.startswith(("step_", ".tmp-"))) == \
        ["step_00000002", "step_00000004", "step_00000006"]  # the partial dirs were replaced
    assert store.is_complete(ckpt / "step_00000006")
    assert [r["step"] for r in _train_records(run_dir)][-4:] == [3, 4, 5, 6]


# ------------------------------------------------------------------------------------------ corrupt shards

def test_truncated_shard_detected_on_open_and_training_refuses(tmp_path, tiny_corpus, tiny_overrides, clean_env,
                                                               capsys):
    ds = _copy_dataset(tiny_corpus["train"], tmp_path / "train")
    bin_path = ds / "shard-00000.bin"
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 2)
    with pytest.raises(ValueError, match="shard-00000.bin is truncated or corrupt"):
        ShardedDataset(str(ds))
    problems = verify_dataset(str(ds))
    assert problems and "shard shard-00000" in problems[0] and "bytes, manifest says" in problems[0]

    code, out = _main(tiny_overrides(tmp_path / "run", data__sources=f"[{{name: docs, path: {ds}}}]",
                                     data__valid="[]"), capsys)
    assert code == 2, out[-2000:]
    assert "shard-00000.bin is truncated or corrupt" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a step ran on a truncated shard"


def test_flipped_bytes_detected_by_verify_or_on_open(tmp_path, tiny_corpus, capsys):
    from pretrain.prep.preprocess import main as preprocess_main

    ds = _copy_dataset(tiny_corpus["train"], tmp_path / "bin")
    bin_path = ds / "shard-00000.bin"
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    bin_path.write_bytes(bytes(data))
    ShardedDataset(str(ds))  # opens (structure intact) ...
    assert preprocess_main(["--verify", str(ds)]) == 1  # ... but --verify names the shard
    err = capsys.readouterr().err
    assert "shard-00000.bin sha256 mismatch" in err

    ds2 = _copy_dataset(tiny_corpus["train"], tmp_path / "idx")
    idx_path = ds2 / "shard-00000.idx"
    raw = bytearray(idx_path.read_bytes())
    raw[40 + 8 * 3] ^= 0x40  # an offset inside the .idx: sizes/offsets no longer tile the .bin
    idx_path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"shard-00000.idx is corrupt"):
        ShardedDataset(str(ds2))
    assert preprocess_main(["--verify", str(ds2)]) == 1
    assert "shard-00000.idx sha256 mismatch" in capsys.readouterr().err


@pytest.mark.parametrize("num_workers", [0, 1])
def test_token_ids_out_of_range_stop_the_run_naming_shard_and_offset(num_workers, tmp_path, tiny_corpus,
                                                                   tiny_overrides, clean_env, capsys):
    """A corrupted region (the first token of every sentence of shard 0 becomes 0xFFFF, same size, structure intact)
    stops the run at its first read, in the loader (or its worker), before a step: shard and offset named."""
    import numpy as np

    from pretrain.data.indexed import IndexedDataset
    from pretrain.data.shards import CorruptShardError

    ds = _copy_dataset(tiny_corpus["train"], tmp_path / "bad")
    offsets = np.array(IndexedDataset(str(ds / "shard-00000")).offsets)
    bin_path = ds / "shard-00000.bin"
    tokens = np.fromfile(bin_path, dtype=np.uint16)
    tokens[offsets] = 0xFFFF
    tokens.tofile(bin_path)
    # A dataset written before the manifest recorded sampled digests (which would refuse it at open): the read-time
    # check is what finds the damage there, and in regions between the sampled blocks of a new one.
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest.pop("sampled_sha256", None)
    for shard in manifest["shards"]:
        shard.pop("bin_sampled_sha256", None), shard.pop("idx_sampled_sha256", None)
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptShardError, match=rf"shard-00000.bin holds token id 65535 at token offset "
                                                rf"{offsets[3]} \(byte {2 * offsets[3]}\), outside the dataset's "
                                                rf"vocabulary of 2000 ids"):
        ShardedDataset(str(ds))[3]
    code, out = _main(tiny_overrides(tmp_path / "run", data__sources=f"[{{name: docs, path: {ds}}}]",
                                     data__valid="[]", data__num_workers=num_workers), capsys)
    assert code == 2, out[-2000:]
    line = next(x for x in out.splitlines() if "holds token id 65535" in x)
    assert "shard-00000.bin" in line and "pretrain-preprocess --verify" in line and "Traceback" not in out, out[-3000:]
    offset = int(line.split("at token offset ")[1].split()[0])
    assert offset in set(offsets.tolist())
    assert not _train_records(tmp_path / "run"), "a step ran on a corrupt shard"
    from pretrain.data.loader import _LIVE_WORKERS

    assert not [w.pid for w in _LIVE_WORKERS if w.is_alive()], "the run's loader workers outlived it"


# -------------------------------------------------------------------------------- world size on resume

def _launch(overrides: list[str], nproc: int, script: Path | None = None) -> subprocess.Popen:
    """torchrun with nproc ranks of pretrain.train (or of ``script``, which then calls pretrain.train.main)."""
    target = [str(script)] if script is not None else ["-m", "pretrain.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *target, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _train_records(run_dir)}


@pytest.mark.slow
def test_resume_with_other_rank_count(tmp_path, tiny_overrides, clean_env, capsys):
    """A 2-rank checkpoint resumed on 1 rank. ZeRO-1: a conflicting explicit grad_accum and a ZeRO-stage change
    at the same time are refused, saying what works; left alone, micro_batch_size is doubled (same global batch,
    same micro-steps), the optimizer state re-split through a universal copy, and the losses continue. ZeRO-0
    resumes as before. (4 -> 2, 2 -> 4 and every ZeRO stage: test_reshard_resume.py.)"""
    no_dropout = dict(model__dropout=0.0, model__attention_dropout=0.0, data__valid="[]", train__max_steps=4,
                      checkpoint__every=2)
    z1, z0 = tmp_path / "z1", tmp_path / "z0"
    for run_dir, stage in ((z1, 1), (z0, 0)):
        p = _launch(tiny_overrides(run_dir, distributed__zero_stage=stage, **no_dropout), nproc=2)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        shutil.rmtree(store.checkpoints_dir(run_dir) / "step_00000004")  # resume from step 2
        (store.checkpoints_dir(run_dir) / "latest").write_text("step_00000002\n")
    tag_dir = store.checkpoints_dir(z1) / "step_00000002"
    files_before = sorted(p.name for p in tag_dir.iterdir())

    code, out = _main(tiny_overrides(z1, distributed__zero_stage=1, train__grad_accum=3, **no_dropout), capsys)
    assert code == 2
    assert "global batch of 8 sequences (micro_batch_size 4 x grad_accum 1 x 2 ranks)" in out
    assert "train.micro_batch_size=4 x train.grad_accum=3 x 1 rank gives 12" in out
    assert "must be 8: 8 x 1, 4 x 2, 2 x 4, 1 x 8" in out
    code, out = _main(tiny_overrides(z1, distributed__zero_stage=2, **no_dropout), capsys)
    assert code == 2
    assert "written by 2 ranks under ZeRO-1" in out and "not both in one resume" in out

    ref = {r["step"]: r for r in _train_records(z1)}
    code, out = _main(tiny_overrides(z1, distributed__zero_stage=1, **no_dropout), capsys)
    assert code == 0, out[-2000:]
    assert "resuming a 2-rank checkpoint on 1 rank: train.micro_batch_size 4 -> 8 (grad_accum 1)" in out
    assert "at step 2 (written by 2 ranks)" in out
    assert "converting checkpoint" in out and "universal layout for 1 rank" in out
    got = [r for r in _train_records(z1) if r["step"] in (3, 4)][-2:]
    assert [r["step"] for r in got] == [3, 4]
    for r in got:  # the same micro-step batches, the same optimizer state: equal up to rounding
        for key in ("loss", "mlm", "nt_xent"):
            assert r[key] == pytest.approx(ref[r["step"]][key], rel=1e-5), key
    universal = store.checkpoints_dir(z1) / "universal"
    assert sorted(p.name for p in universal.iterdir()) == ["step_00000002"]  # published; no temporary left
    assert (universal / "step_00000002" / UNIVERSAL_SOURCE).is_file()
    assert sorted(p.name for p in tag_dir.iterdir()) == files_before  # the checkpoint itself is only read
    assert store.verify_checkpoint(tag_dir, full=True) == []
    import yaml

    assert yaml.safe_load((z1 / "config.yaml").read_text())["train"]["micro_batch_size"] == 8  # what ran
    state = json.loads((store.checkpoints_dir(z1) / "step_00000004" / store.STATE_FILE).read_text())
    assert (state["world_size"], state["micro_batch_size"], state["requested_batch"]) == (1, 8, [4, 1])

    # A damaged universal copy is rebuilt, never used: one of its files truncated, step 2 resumed once more.
    shutil.rmtree(store.checkpoints_dir(z1) / "step_00000004")
    (store.checkpoints_dir(z1) / "latest").write_text("step_00000002\n")
    victim = next((universal / "step_00000002" / "zero").rglob("exp_avg.pt"))
    victim.write_bytes(victim.read_bytes()[:-8])
    code, out = _main(tiny_overrides(z1, distributed__zero_stage=1, **no_dropout), capsys)
    assert code == 0, out[-2000:]
    assert f"rebuilding {universal / 'step_00000002'}" in out and "(truncated?)" in out
    got = [r for r in _train_records(z1) if r["step"] in (3, 4)][-2:]
    for r in got:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-5)

    ref = {r["step"]: r for r in _train_records(z0)}
    code, out = _main(tiny_overrides(z0, distributed__zero_stage=0, **no_dropout), capsys)
    assert code == 0, out[-2000:]
    assert "at step 2" in out and "converting" not in out  # ZeRO-0 keeps the optimizer state whole
    got = [r for r in _train_records(z0) if r["step"] in (3, 4)][-2:]
    assert [r["step"] for r in got] == [3, 4]
    for r in got:  # same samples, same negatives (gathered), one rank instead of two: equal up to rounding
        for key in ("loss", "mlm", "nt_xent"):
            assert r[key] == pytest.approx(ref[r["step"]][key], rel=1e-5), key


# -------------------------------------------------------------------------------- one rank SIGKILLed

@pytest.mark.slow
def test_one_rank_sigkilled_job_exits_bounded_and_relaunch_resumes(tmp_path, tiny_overrides, clean_env, capsys):
    run_dir = tmp_path / "kill"
    # A kill that lands while rank 1 writes its share of a background checkpoint left rank 0's writer waiting for
    # rank 1's marker until distributed.timeout_s (31 s at timeout_s=30, measured); since 2026-12-08 rank 0 sees the
    # process gone (test_a_rank_killed_while_it_writes_its_share_ends_the_job_at_once). The timeout stays a bound.
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=400, checkpoint__every=4,
                          distributed__timeout_s=15)
    p = _launch(args, nproc=2)
    ckpt = store.checkpoints_dir(run_dir)
    deadline = time.time() + 240
    while not (ckpt / "latest").is_file() or not (run_dir / "metrics.jsonl").is_file() \
            or len(_train_records(run_dir)) < 6:
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    t0 = time.time()
    os.kill(int(workers[1]), signal.SIGKILL)  # rank 1 (or 0) dies mid-step
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    elapsed = time.time() - t0
    assert p.returncode != 0, out[-3000:]
    assert elapsed < 120
    # The survivor says in one line that a rank is gone and what to resume from, not the collective's traceback.
    assert re.search(r"pretrain-train: error \(rank [01]\): another rank of the job is gone \(", out), out[-3000:]
    assert "relaunch the job to resume from it" in out and "]:   File" not in out, out[-3000:]
    last = store.find_latest(ckpt)
    assert last is not None and store.is_complete(ckpt / last)
    step = int(last.split("_")[1])

    relaunch = [a for a in args if not a.startswith("train.max_steps=")] + [f"train.max_steps={step + 2}"]
    q = _launch(relaunch, nproc=2)
    out, _ = q.communicate(timeout=300)
    assert q.returncode == 0, out[-3000:]
    assert f"resumed from {ckpt / last} at step {step}" in out
    assert store.find_latest(ckpt) == store.tag_for_step(step + 2)
    print(f"job exited {elapsed:.1f}s after the SIGKILL")


_RANK_1_WRITES_SLOWLY = """
import os, time
from pretrain.checkpoint import writer
real_write_share = writer.write_share
def slow_write_share(job):
    if job.rank == 1 and job.step >= 4:  # from the second save on: the first stays the one to resume from
        print(f"rank 1 writes its share of step {job.step}: pid {os.getpid()}", flush=True)
        time.sleep(90)  # the SIGKILL lands here
    return real_write_share(job)
writer.write_share = slow_write_share
from pretrain.train import cli
cli()
"""


@pytest.mark.slow
def test_a_rank_killed_while_it_writes_its_share_ends_the_job_at_once(tmp_path, tiny_overrides):
    """The OOM killer takes rank 1 while its writer thread writes its share of a background checkpoint. Rank 0's
    writer waited for rank 1's marker until distributed.timeout_s, so rank 0 sat in its close until torchrun
    SIGKILLed it 30 s after tearing the job down: the partial tag and the run's lock were left behind. Now rank 0
    sees that rank 1's process is gone, removes the partial tag, says so and releases the lock."""
    run_dir = tmp_path / "run"
    script = tmp_path / "slow_rank_1.py"
    script.write_text(_RANK_1_WRITES_SLOWLY)
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=2,
                          distributed__timeout_s=60)
    p = _launch(args, nproc=2, script=script)
    seen, t0 = [], None
    try:
        for line in p.stdout:
            seen.append(line)
            found = re.search(r"rank 1 writes its share of step \d+: pid (\d+)", line)
            if found:
                time.sleep(0.5)  # into the sleep: the writer thread runs, rank 0 waits for its marker
                os.kill(int(found.group(1)), signal.SIGKILL)
                t0 = time.time()
                break
        out = "".join(seen) + p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    elapsed = time.time() - t0
    assert t0 is not None and p.returncode != 0, out[-3000:]
    assert elapsed < 20, (elapsed, out[-3000:])  # torchrun's SIGKILL came 30 s after its SIGTERM
    assert re.search(r"rank 1's process \(pid \d+\) ended before it finished writing its files", out), out[-4000:]
    # Rank 0 is usually waiting for this save at its next one by then (its error names the save); under load the
    # kill may land in a step's collective instead, and the trainer's close reports the save.
    assert "pretrain-train: error (rank 0): another rank of the job is gone (" in out, out[-4000:]
    assert f"The last good checkpoint is {store.checkpoints_dir(run_dir) / 'step_00000002'}: relaunch" in out
    assert "saving checkpoint step_00000004 failed" in out or \
        "the checkpoint being written when the run ended failed" in out, out[-4000:]
    assert "[rank0]:   File" not in out, out[-4000:]  # no traceback of the collective
    assert "exitcode  : 69" in out, out[-4000:]
    ckpts = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpts) == "step_00000002" and store.is_complete(ckpts / "step_00000002")
    assert not [q.name for q in ckpts.iterdir() if q.name.startswith(".tmp-")], list(ckpts.iterdir())
    assert not (run_dir / "run.lock").exists()
    print(f"job exited {elapsed:.1f}s after the SIGKILL; rank 0 said:",
          *[line for line in out.splitlines() if "pretrain-train" in line or "warning" in line], sep="\n")


# ------------------------------------------------------------------------------ two trainers, one run_dir

@pytest.mark.slow
def test_second_trainer_on_a_run_dir_in_use_exits_at_once_naming_the_holder(tmp_path, tiny_overrides):
    """The usual case: a requeued job starts while the old one still runs. The newcomer stops at once
    (before DeepSpeed starts), non-zero, naming the holder; the holder is undisturbed and releases on exit."""
    import socket

    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=0)
    # The holder logs every step for as long as the newcomer takes to start: its output goes to a file, which never
    # fills (an unread pipe does, at 64 KiB, and then blocks the holder's next print, SIGTERM's checkpoint included:
    # seen in CI on a loaded machine).
    log = tmp_path / "first.log"
    with open(log, "w") as sink:
        first = subprocess.Popen([sys.executable, "-m", "pretrain.train", *args], cwd=REPO, env=_env(),
                                 stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the first trainer never logged a step"
            time.sleep(0.2)
        t0 = time.time()
        second = subprocess.run([sys.executable, "-m", "pretrain.train", *args], cwd=REPO, env=_env(),
                                capture_output=True, text=True, timeout=120)
        took = time.time() - t0
        out = second.stdout + second.stderr
        assert second.returncode == 2, out[-3000:]
        assert f"is in use by another trainer: host {socket.gethostname()}, pid {first.pid}" in out, out[-3000:]
        assert "Traceback" not in out and took < 60
        assert first.poll() is None  # the holder runs on
    finally:
        os.killpg(first.pid, signal.SIGTERM)  # checkpoints and exits 75; the lock goes with it
        first.wait(timeout=240)
    assert first.returncode == 75, log.read_text()[-3000:]
    assert not (run_dir / "run.lock").exists()


# ------------------------------------------------------------------------------ resume with another model

@pytest.mark.slow
def test_resume_with_a_changed_model_or_tokenizer_is_refused_before_loading(tmp_path, tiny_overrides, clean_env,
                                                                            capsys, tiny_corpus):
    """Through the real CLI entry point: the differing keys are listed with both values and both ways
    forward; safe changes (max_steps, logging, checkpoint cadence) still resume."""
    run_dir = tmp_path / "run"
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=2, checkpoint__every=2), capsys)
    assert code == 0, out[-2000:]

    # A checkpoint of the format before the sample stream was recorded (numpy Generators per sample): its
    # remaining samples would get other noise here, so it is refused too (weights-only init_from is the way).
    state_file = store.checkpoints_dir(run_dir) / store.find_latest(store.checkpoints_dir(run_dir)) / "trainer_state.json"
    original = state_file.read_text()
    state = json.loads(original)
    assert state["format_version"] == 3 and state["sample_stream"] == "counter-v3"
    del state["sample_stream"]
    state_file.write_text(json.dumps(dict(state, format_version=1)))
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4), capsys)
    assert code == 2 and "sample stream 'generator-v1'" in out and "checkpoint.init_from=" in out, out[-2000:]
    state_file.write_text(original)

    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, model__hidden_size=48,
                                     model__ffn_size=96), capsys)
    assert code == 2, out[-2000:]
    assert "model.ffn_size: 64 in the checkpoint, 96 now" in out and "model.hidden_size: 32 in the checkpoint, 48 now" in out
    assert "start a new run_dir" in out and "checkpoint.init_from=" in out and "Traceback" not in out
    # init_from loads the checkpoint's model, not another size (a user who followed "where their shapes fit" with
    # model=mini was refused again)
    assert "the checkpoint's model settings (weights of another size or vocabulary cannot be loaded" in out

    other_tok = tmp_path / "other_tokenizer.json"
    from pretrain.prep.preprocess import preprocess
    from pretrain.prep.tokenizer import train_tokenizer

    text = f"{tiny_corpus['dir']}/text/valid.txt"
    train_tokenizer([text], str(other_tok), kind="wordpiece", vocab_size=500)
    preprocess([text], str(tmp_path / "other_data"), str(other_tok), num_workers=1, progress=False)
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, data__tokenizer=str(other_tok),
                                     data__sources=f"[{{name: d, path: {tmp_path / 'other_data'}}}]"), capsys)
    assert code == 2 and "is not the tokenizer the checkpoint was trained with" in out, out[-2000:]
    assert "model.vocab_size: 2000 in the checkpoint" in out

    # Another precision (DeepSpeed's optimizer files differ) or another seed (the sample order follows from it) is
    # refused before anything loads, naming the key.
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, train__precision="bf16"), capsys)
    assert code == 2 and "train.precision=fp32; this run has train.precision=bf16" in out, out[-2000:]
    assert "Traceback" not in out and "No such file" not in out
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, seed=99), capsys)
    assert code == 2 and "seed=1234; this run has seed=99" in out, out[-2000:]

    # A sample order this version does not know is refused; a checkpoint from before orders were recorded
    # (numpy permutations per epoch) resumes in that order, says so, and keeps recording it.
    state = json.loads(original)
    assert state["sample_order"] == "feistel-v1"
    state_file.write_text(json.dumps(dict(state, sample_order="shuffled-v9")))
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4), capsys)
    assert code == 2 and "orders its samples by 'shuffled-v9'" in out and "Traceback" not in out, out[-2000:]
    del state["sample_order"]
    state_file.write_text(json.dumps(dict(state, format_version=2)))
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, train__log_every=2,
                                     checkpoint__every=4), capsys)
    assert code == 0 and "resumed from" in out, out[-2000:]
    assert "the checkpoint orders its samples by 'permutation-v1'" in out, out[-2000:]
    last = store.checkpoints_dir(run_dir) / store.find_latest(store.checkpoints_dir(run_dir)) / "trainer_state.json"
    assert json.loads(last.read_text())["sample_order"] == "permutation-v1"


# ------------------------------------------------------------------------------ signals to the whole job

def _start_and_wait_for_a_step(run_dir, args):
    p = subprocess.Popen([sys.executable, "-m", "pretrain.train", *args], cwd=REPO, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not (run_dir / "metrics.jsonl").is_file() or '"split": "train"' not in (run_dir / "metrics.jsonl").read_text():
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.time() < deadline, "no step was logged"
        time.sleep(0.2)
    return p


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_signal_to_the_whole_process_group_checkpoints_and_exits(sig, code, tmp_path, tiny_overrides):
    """Ctrl-C / scancel / timeout send the signal to every process of the job, DataLoader workers included:
    the workers ignore it, the main process finishes the step, checkpoints and exits (130 for Ctrl-C, 75 to
    be requeued)."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=0,
                          data__num_workers=1)
    p = _start_and_wait_for_a_step(run_dir, args)
    os.killpg(p.pid, sig)
    out = p.communicate(timeout=240)[0]
    assert p.returncode == code, out[-3000:]
    assert f"received {sig.name}: will checkpoint after the current step" in out
    assert f"(exit {code})" in out and "Traceback" not in out and "killed by signal" not in out, out[-3000:]
    assert store.find_latest(store.checkpoints_dir(run_dir)) is not None
    assert not (run_dir / "run.lock").exists()


def _forked_children(pid: int) -> list[int]:
    """The processes ``pid`` forked that run its own command line (DataLoader workers: not multiprocessing's
    resource tracker, which is a new interpreter)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    out = []
    for k in kids:
        try:
            if Path(f"/proc/{k}/cmdline").read_bytes() == cmdline:
                out.append(k)
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_a_data_worker_killed_mid_run_ends_the_run_with_exit_5_in_one_line(tmp_path, tiny_overrides):
    """The OOM killer takes a DataLoader worker mid-run: the trainer ends in one line naming the worker, the signal
    and what to do, with exit 5, not the configuration error's 2 (until 2026-12-07: exit 2), and the run resumes."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=2,
                          data__num_workers=1)
    p = _start_and_wait_for_a_step(run_dir, args)
    workers = _forked_children(p.pid)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    out = p.communicate(timeout=240)[0]
    assert p.returncode == 5, out[-3000:]
    line = [ln for ln in out.splitlines() if "pretrain-train: error" in ln]
    assert len(line) == 1 and f"data loader worker 0 (pid {workers[0]}) was killed by SIGKILL" in line[0], out[-3000:]
    assert "resuming continues from the last checkpoint" in line[0] and "Traceback" not in out, out[-3000:]
    assert not (run_dir / "run.lock").exists()


def _slow_steps(patch: str = "", step_waits_for: int = 1) -> str:
    """A trainer whose every step prints "inside a step", then stays in the step for up to 3 s more (a Ctrl-C
    sent at that line lands inside a step, not where the trainer may already be past its check for a stop): until
    its stop-signal handler has been given ``step_waits_for`` signals in all, which ends the wait early; and
    ``patch`` (code run before the trainer starts, which may call ``pause`` too) slowing one more place."""
    return f"""
import os, time
from pretrain.distributed.signals import StopSignal
from pretrain.training.trainer import Trainer
handled = [0]  # the signals the trainer's StopSignal handler has been given
real_handle = StopSignal._handle
def counting_handle(self, signum, frame):
    handled[0] += 1
    return real_handle(self, signum, frame)
StopSignal._handle = counting_handle
def pause(signals):
    \"\"\"Up to 3 s; over as soon as the handler has been given ``signals`` signals (it returned, or raised).\"\"\"
    end = time.monotonic() + 3.0
    while handled[0] < signals and time.monotonic() < end:
        time.sleep(0.01)
real_step = Trainer.train_step
def slow_step(self, *a, **k):
    out = real_step(self, *a, **k)
    print(f"inside a step: pid {{os.getpid()}}", flush=True)
    pause({step_waits_for})
    return out
Trainer.train_step = slow_step
{patch}
from pretrain.train import cli  # the trainer's own exit: flushed, no interpreter teardown
cli()
"""


def _two_ctrl_cs(run_dir: Path, tiny_overrides, *, second_at: str, patch: str = "",
                 step_waits_for: int = 1) -> tuple[int, str]:
    """``_slow_steps(patch, step_waits_for)`` on ``run_dir``: the first Ctrl-C (to the process group, as a terminal
    sends it) inside a step, the second at the first line after it that starts with ``second_at``; (exit code,
    output). One line at a time: each Ctrl-C answers what the trainer says."""
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=0)
    p = subprocess.Popen([sys.executable, "-c", _slow_steps(patch, step_waits_for), *args], cwd=REPO, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, sent = [], False
    for line in p.stdout:
        seen.append(line)
        if line.startswith("inside a step") and not sent:
            os.killpg(p.pid, signal.SIGINT)
            sent = True
        elif sent and line.startswith(second_at):
            os.killpg(p.pid, signal.SIGINT)
            break
    out = "".join(seen) + p.communicate(timeout=240)[0]  # read to the end: a full pipe would block the trainer
    return p.returncode, out


@pytest.mark.slow
def test_second_sigint_aborts_at_once(tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    # The step waits for both Ctrl-Cs: the second must land before the step is over and the stop's checkpoint
    # begins.
    code, out = _two_ctrl_cs(run_dir, tiny_overrides, second_at="received SIGINT", step_waits_for=2)
    assert code == 130, out[-3000:]
    assert "aborted by a second SIGINT (rank 0); nothing was saved since the last checkpoint" in out, out[-3000:]
    assert "Traceback" not in out and "checkpointed step" not in out
    assert store.find_latest(store.checkpoints_dir(run_dir)) is None
    assert not (run_dir / "run.lock").exists()


_SLOW_WRITE = """
import threading
from pretrain.checkpoint import store, writer
cancelled = threading.Event()  # set once this rank's save in flight was told to stop (by the abandon)
real_cancel = writer.CheckpointWriter.cancel
def noting_cancel(self):
    real_cancel(self)
    cancelled.set()
writer.CheckpointWriter.cancel = noting_cancel
real_weights = store.write_weights
def slow_weights(*a, **k):
    print("writing the checkpoint", flush=True)
    # The second Ctrl-C lands while the checkpoint is being written; its abandon ends this wait (at most 3 s),
    # and the writer stops at its next check.
    cancelled.wait(3.0)
    return real_weights(*a, **k)
store.write_weights = slow_weights
"""


@pytest.mark.slow
def test_second_sigint_during_the_save_abandons_the_checkpoint(tmp_path, tiny_overrides):
    """The first Ctrl-C asks for a checkpoint; a second one while it is being written aborts at once: the partial
    checkpoint is removed, not published after the message said nothing was saved, and nothing is left behind."""
    run_dir = tmp_path / "run"
    code, out = _two_ctrl_cs(run_dir, tiny_overrides, second_at="writing the checkpoint", patch=_SLOW_WRITE)
    assert code == 130, out[-3000:]
    assert ("aborted by a second SIGINT (rank 0); nothing was saved since the last checkpoint (the save of step 1 "
            "being written was removed)") in out, out[-3000:]
    assert "Traceback" not in out and "checkpointed step" not in out, out[-3000:]
    ckpts = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpts) is None, out[-3000:]
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith((".tmp-", "step_"))], list(ckpts.iterdir())
    assert not (run_dir / "run.lock").exists()


@pytest.mark.slow
def test_second_sigint_to_every_rank_during_the_save_abandons_it_on_all(tmp_path, tiny_overrides):
    """Two ranks, each given both Ctrl-Cs (as srun delivers them; torchrun answers a second one with SIGTERM, see
    docs/operations.md): rank 0 is writing the checkpoint, rank 1 has written its share and waits. Both abort with
    130, the partial checkpoint is removed and the run directory released."""
    run_dir = tmp_path / "run"
    script = tmp_path / "slow.py"
    script.write_text(_slow_steps(_SLOW_WRITE))
    args = tiny_overrides(run_dir, data__valid="[]", train__max_steps=100000, checkpoint__every=0,
                          distributed__timeout_s=60)
    p = _launch(args, nproc=2, script=script)
    seen, pids, sent = [], set(), False
    for line in p.stdout:
        seen.append(line)
        if "inside a step: pid " in line and not sent:
            pids.update(int(pid) for pid in re.findall(r"inside a step: pid (\d+)", line))  # lines may interleave
            if len(pids) == 2:  # both ranks inside a step
                for pid in pids:
                    os.kill(pid, signal.SIGINT)
                sent = True
        elif sent and "writing the checkpoint" in line:
            for pid in pids:
                os.kill(pid, signal.SIGINT)
            break
    out = "".join(seen) + p.communicate(timeout=240)[0]
    assert p.returncode != 0, out[-3000:]  # torchrun: its ranks exited 130
    assert out.count("exitcode  : 130") == 2, out[-4000:]
    assert re.search(r"aborted by a second SIGINT \(rank 0\); nothing was saved since the last checkpoint \(the "
                     r"save of step \d+ being written was removed\)", out), out[-4000:]
    assert "aborted by a second SIGINT (rank 1)" in out and "/pretrain/" not in out.split("ChildFailedError")[0], \
        out[-4000:]  # no traceback of the trainer's
    ckpts = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpts) is None, out[-3000:]
    assert not [q.name for q in ckpts.iterdir() if q.name.startswith((".tmp-", "step_"))], list(ckpts.iterdir())
    assert not (run_dir / "run.lock").exists()


_SLOW_CLOSE = """
real_close = Trainer.close
def slow_close(self):
    print("closing", flush=True)
    pause(2)  # the second Ctrl-C lands while the trainer closes, after the stop's checkpoint
    return real_close(self)
Trainer.close = slow_close
"""


@pytest.mark.slow
def test_second_sigint_while_the_trainer_closes_does_not_cut_the_close_short(tmp_path, tiny_overrides):
    """The first Ctrl-C's checkpoint is published and the trainer closes; a second Ctrl-C then used to raise in
    the middle of the close: a traceback, exit -2 and the run directory's lock left behind. Now the close goes on:
    the lock is released and the exit is the stop's 130."""
    run_dir = tmp_path / "run"
    code, out = _two_ctrl_cs(run_dir, tiny_overrides, second_at="closing", patch=_SLOW_CLOSE)
    assert code == 130, out[-3000:]
    assert "received SIGINT while stopping: the run directory is released before the exit" in out, out[-3000:]
    assert "Traceback" not in out and "checkpointed step 1" in out, out[-3000:]
    assert not (run_dir / "run.lock").exists()
    ckpts = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpts) == "step_00000001" and store.is_complete(ckpts / "step_00000001")


# ------------------------------------------------------------------------------ checkpoint integrity

@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_and_is_refused_by_weight_readers(tmp_path, tiny_overrides, clean_env,
                                                                               capsys):
    """Really truncated and bit-flipped files: ``--check`` names them, resume falls back to the newest intact
    checkpoint with a warning naming both, and convert/init_from refuse the damaged one with the same reason."""
    from pretrain.export.convert import main as convert_main
    from pretrain.train import main as train_main

    run_dir = tmp_path / "run"
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, checkpoint__every=2), capsys)
    assert code == 0, out[-2000:]
    ckpts = store.checkpoints_dir(run_dir)
    assert store.list_complete(ckpts) == ["step_00000002", "step_00000004"]
    recorded = json.loads((ckpts / "step_00000004" / store.FILES_FILE).read_text())["files"]
    assert "mp_rank_00_model_states.pt" in recorded and "config.yaml" in recorded
    assert train_main(["--check", str(run_dir)]) == 0
    assert capsys.readouterr().out.count(" good") == 2

    model_file = ckpts / "step_00000004" / "mp_rank_00_model_states.pt"
    size = model_file.stat().st_size
    with open(model_file, "r+b") as f:
        f.truncate(size // 2)
    assert train_main(["--check", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"step_00000004  damaged: mp_rank_00_model_states.pt has {size // 2} bytes, {size} when it was written" in out
    assert "step_00000002  good" in out and "a resume would start from: step_00000002" in out

    assert convert_main(["to-hf", str(ckpts / "step_00000004"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "step_00000004 is damaged: mp_rank_00_model_states.pt has" in err and "Traceback" not in err
    code, out = _main(tiny_overrides(tmp_path / "other", data__valid="[]", train__max_steps=1,
                                     checkpoint__init_from=str(ckpts / "step_00000004")), capsys)
    assert code == 4 and "is damaged: mp_rank_00_model_states.pt" in out, out[-2000:]

    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=6, checkpoint__every=2), capsys)
    assert code == 0, out[-2000:]
    assert "checkpoint" in out and "step_00000004 is damaged: mp_rank_00_model_states.pt" in out
    assert "resuming from" in out and "step_00000002, the newest checkpoint that is intact" in out
    assert "resumed from" in out and "at step 2" in out
    assert train_main(["--check", str(run_dir)]) == 0  # step 4 rewritten by the resumed run, step 6 added
    capsys.readouterr()

    # A flipped byte (same size) is caught by the checksums: the sampled one covers a small file whole.
    cfg_file = ckpts / "step_00000006" / "config.yaml"
    raw = bytearray(cfg_file.read_bytes())
    raw[0] ^= 1
    cfg_file.write_bytes(bytes(raw))
    assert store.verify_checkpoint(ckpts / "step_00000006") == [
        "config.yaml: sampled sha256 differs from when it was written (the file changed or is corrupt)"]


class _Planted:
    """Unpickling this creates a file: proof that code from a checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _refresh_files_json(tag_dir: Path) -> None:
    """What someone handing over a doctored checkpoint would do: make files.json agree with the files."""
    entries = {p.name: store.file_digests(p) for p in tag_dir.iterdir()
               if p.is_file() and p.name not in (store.STATE_FILE, store.FILES_FILE)}
    (tag_dir / store.FILES_FILE).write_text(json.dumps({"files": entries}))


@pytest.mark.slow
def test_weight_readers_never_unpickle_a_foreign_checkpoint(tmp_path, tiny_overrides, clean_env, capsys):
    """A checkpoint whose DeepSpeed files carry a planted pickle: convert and init_from read model.safetensors
    and run nothing; without model.safetensors they refuse (naming --trust-checkpoint) and still run nothing."""
    import pickle

    from pretrain.export.convert import main as convert_main

    run_dir = tmp_path / "run"
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=2, checkpoint__every=2), capsys)
    assert code == 0, out[-2000:]
    tag_dir = store.checkpoints_dir(run_dir) / "step_00000002"
    from safetensors.torch import load_file

    weights = load_file(str(tag_dir / store.WEIGHTS_FILE))
    assert "encoder.embeddings.word.weight" in weights and all(v.dtype == torch.float32 for v in weights.values())

    marker = tmp_path / "pwned"
    for f in tag_dir.glob("*model_states.pt"):
        with open(f, "wb") as fh:
            pickle.dump({"module": _Planted(marker)}, fh)
    _refresh_files_json(tag_dir)
    assert convert_main(["to-hf", str(tag_dir), str(tmp_path / "hf")]) == 0
    code, out = _main(tiny_overrides(tmp_path / "init", data__valid="[]", train__max_steps=1,
                                     checkpoint__init_from=str(tag_dir)), capsys)
    assert code == 0, out[-2000:]
    from pretrain.eval.encoder import load_backbone
    from pretrain.training.resources import load_teacher

    load_backbone(tag_dir)  # pretrain-eval / pretrain-finetune-glue --model
    load_teacher(str(tag_dir))  # RankCSE teachers
    assert not marker.exists()

    (tag_dir / store.WEIGHTS_FILE).unlink()
    _refresh_files_json(tag_dir)
    assert convert_main(["to-hf", str(tag_dir), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "has no model.safetensors" in err and "--trust-checkpoint" in err and "Traceback" not in err
    code, out = _main(tiny_overrides(tmp_path / "init2", data__valid="[]", train__max_steps=1,
                                     checkpoint__init_from=str(tag_dir)), capsys)
    assert code == 4 and "checkpoint.trust=true" in out, out[-2000:]
    for read in (lambda: load_backbone(tag_dir), lambda: load_teacher(str(tag_dir))):
        with pytest.raises(store.CheckpointError, match="has no model.safetensors"):
            read()
    assert not marker.exists()
