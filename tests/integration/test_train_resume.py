"""tiny corpus -> tokenizer -> preprocess -> train on 2 gloo ranks -> kill -> resume -> same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def _launch(overrides: list[str], nproc: int) -> subprocess.Popen:
    if nproc == 1:
        cmd = [sys.executable, "-m", "pretrain.train", *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "pretrain.train", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _run(overrides, nproc, timeout=300) -> tuple[int, str]:
    p = _launch(overrides, nproc)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_at_first_checkpoint(overrides: list[str], run_dir: Path, nproc: int) -> None:
    """Launch, and SIGKILL the whole job as soon as its first checkpoint is published (steps 5-8 and their save take
    well under a second: killed before they finish); that checkpoint must be step 4."""
    p = _launch(overrides, nproc=nproc)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "latest").is_file():
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def _check_run_dir(run_dir: Path, losses: dict) -> None:
    """config.yaml, metrics.jsonl fields, and real TensorBoard events carrying the same scalars."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"] == 8
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    for key in ("step", "loss", "mlm", "nt_xent", "lr", "grad_norm", "loss_scale", "tokens_per_s", "samples_per_s",
                "data_wait_frac"):
        assert key in rec, key
    assert 0.0 <= rec["data_wait_frac"] < 1.0, rec["data_wait_frac"]
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == sorted(losses)
    for e in events:
        assert abs(e.value - losses[e.step]) < 1e-6
    assert "valid/mlm" in acc.Tags()["scalars"]


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_reproduce_losses_bitwise(tmp_path, tiny_overrides):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    code, out = _run(tiny_overrides(ref_dir), nproc=2)
    assert code == 0, out[-3000:]
    ref = _losses(ref_dir)
    assert sorted(ref) == list(range(1, 9))
    _check_run_dir(ref_dir, ref)

    _kill_at_first_checkpoint(tiny_overrides(cut_dir), cut_dir, nproc=2)

    code, out = _run(tiny_overrides(cut_dir), nproc=2)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(cut_dir) == ref  # bitwise: same floats, every step


@pytest.mark.slow
def test_stop_signal_checkpoints_and_exits_for_requeue(tmp_path, tiny_overrides):
    run_dir = tmp_path / "sig"
    p = _launch(tiny_overrides(run_dir, train__max_steps=200, checkpoint__every=0), nproc=1)
    deadline = time.time() + 240
    while not (run_dir / "metrics.jsonl").is_file() or len(_losses(run_dir)) < 2:
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGUSR1)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 75, out[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert 2 <= step < 200
    state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == step and state["consumed_samples"] == step * 4
    record = json.loads((run_dir / "stop.json").read_text())  # for a launcher that sees another code (srun)
    assert record["code"] == 75 and record["step"] == step and record["checkpoint"].endswith(latest)


def test_gradient_accumulation_steps_once_per_global_batch(tmp_path, tiny_overrides, clean_env):
    """grad_accum=2: one optimizer update (and one LR-schedule step) per trainer step, finite norms. (In this
    process: the trainer is what is tested, and a subprocess only added its start-up.)"""
    from pretrain.train import main

    run_dir = tmp_path / "ga"
    assert main(tiny_overrides(run_dir, train__grad_accum=2, train__micro_batch_size=2, train__max_steps=4,
                               optim__warmup_steps=4, checkpoint__every=0)) == 0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    assert [r["lr"] for r in train] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3])
    assert all(isinstance(r["grad_norm"], float) and r["grad_norm"] > 0 for r in train)
    state = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["consumed_samples"] == 4 * 2 * 2


class _Crash(RuntimeError):
    """A crash injected at the start of a step (the process dies before that step's records)."""


def _crash_before_step(monkeypatch, step: int) -> None:
    from pretrain.training.trainer import Trainer

    orig = Trainer.train_step

    def train_step(self, loader):
        if self.state.step + 1 == step:
            raise _Crash(f"crash before step {step}")
        return orig(self, loader)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def _reference_and_relaunched(tmp_path, tiny_overrides, monkeypatch, ov: dict, *, crash_step: int,
                              latest: str | None) -> tuple[Path, Path]:
    """(ref, run): an uninterrupted run, and one that crashes before ``crash_step`` with ``latest`` its newest
    checkpoint (None: none yet) and is relaunched with the same command to the end."""
    from pretrain.train import main

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    assert main(tiny_overrides(ref_dir, **ov)) == 0
    with monkeypatch.context() as m:
        _crash_before_step(m, crash_step)
        with pytest.raises(_Crash):
            main(tiny_overrides(run_dir, **ov))
    pointer = run_dir / "checkpoints" / "latest"
    assert (pointer.read_text().strip() if pointer.exists() else None) == latest
    assert main(tiny_overrides(run_dir, **ov)) == 0
    return ref_dir, run_dir


def _records(run_dir: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["split"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's reading of every event file under tb/ (later launches' purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_log_window_cut_by_a_resume_logs_the_uninterrupted_figures(tmp_path, tiny_overrides, clean_env,
                                                                   monkeypatch):
    """train.log_every=3 with checkpoint.every=4: the run dies before step 6 and resumes from step 4, in the middle
    of the window 4-6. Step 6's record still holds the means over steps 4-6, as the uninterrupted run's, in
    metrics.jsonl and TensorBoard; every record once."""
    ov = dict(train__log_every=3, checkpoint__every=4, train__max_steps=6, data__valid="[]")
    ref_dir, cut_dir = _reference_and_relaunched(tmp_path, tiny_overrides, monkeypatch, ov, crash_step=6,
                                                 latest="step_00000004")

    ref = {r["step"]: r for r in map(json.loads, (ref_dir / "metrics.jsonl").read_text().splitlines())
           if r["split"] == "train"}
    assert _records(cut_dir) == _records(ref_dir)
    got = {r["step"]: r for r in map(json.loads, (cut_dir / "metrics.jsonl").read_text().splitlines())
           if r["split"] == "train"}
    for key in ("loss", "mlm", "nt_xent", "lr"):
        assert [got[s][key] for s in (3, 6)] == pytest.approx([ref[s][key] for s in (3, 6)], rel=1e-9), key
    tb = _tb_scalars(cut_dir)
    assert sorted(tb) == sorted(_tb_scalars(ref_dir))
    assert tb["train/loss"] == [(s, pytest.approx(got[s]["loss"], rel=1e-6)) for s in (3, 6)]


def test_relaunch_after_a_crash_before_the_first_checkpoint_logs_each_step_once(tmp_path, tiny_overrides,
                                                                               clean_env, monkeypatch):
    """The first launch dies at step 3, before any checkpoint: the next one starts the run over from step 0 in the
    same directory. metrics.jsonl and TensorBoard then hold the records of that run once each (the first launch's
    step-0 validation and steps 1-2 went with it), as an uninterrupted run's."""
    ov = dict(checkpoint__every=4, train__max_steps=4)
    ref_dir, run_dir = _reference_and_relaunched(tmp_path, tiny_overrides, monkeypatch, ov, crash_step=3, latest=None)

    assert _records(run_dir) == _records(ref_dir)
    tb, ref = _tb_scalars(run_dir), _tb_scalars(ref_dir)
    assert sorted(tb) == sorted(ref)
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "valid/mlm"):
        assert [s for s, _ in tb[tag]] == [s for s, _ in ref[tag]], tag
