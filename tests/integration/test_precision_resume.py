"""A resume keeps the precision its run was trained in: DeepSpeed's optimizer state has another layout per
precision. An explicit change is refused with what to do; ``train.precision=auto`` on a CPU takes the run's own
precision when the requeue lands on a CPU of the other kind (with or without AMX-BF16), instead of being refused.

The kind of CPU is a written /proc/cpuinfo (``pretrain.config.train.CPUINFO``), so both kinds run on any machine;
the trainer runs in-process on the tiny corpus, real DeepSpeed."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import train as train_config
from tests.integration.test_faults import _losses, _main

AMX = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
NO_AMX = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's kind decides auto only without a GPU")


def _cpu(monkeypatch, tmp_path, flags: str) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(flags)
    monkeypatch.setattr(train_config, "CPUINFO", str(cpuinfo))


def test_auto_on_a_cpu_resumes_in_the_runs_precision_and_an_explicit_change_is_refused(tmp_path, tiny_overrides,
                                                                                       capsys, monkeypatch):
    run = tmp_path / "run"

    def argv(steps: int, precision: str = "auto") -> list[str]:
        return [*tiny_overrides(run, train__max_steps=steps, checkpoint__every=2, train__log_every=1,
                                train__eval_every=0), f"train.precision={precision}"]

    _cpu(monkeypatch, tmp_path, AMX)  # the run starts on a CPU with AMX-BF16: auto is bf16
    code, out = _main(argv(2), capsys)
    assert code == 0 and "precision bf16" in out, out[-3000:]
    first = _losses(run)
    assert sorted(first) == [1, 2]

    _cpu(monkeypatch, tmp_path, NO_AMX)  # requeued onto one without: alone it would pick fp32
    code, out = _main(argv(4, "fp32"), capsys)  # an explicit other precision: refused, nothing written
    assert code != 0 and "was trained with train.precision=bf16" in out and "train.precision=fp32" in out, out[-3000:]
    assert _losses(run) == first
    code, out = _main(argv(4), capsys)
    assert code == 0, out[-3000:]
    assert "train.precision=auto: bf16" in out and "this machine alone would pick fp32" in out, out[-3000:]
    assert "precision bf16" in out and "resumed from" in out and "step_00000002" in out, out[-3000:]
    assert "warning: train.precision=bf16 on a CPU without AMX-BF16" in out
    resumed = _losses(run)
    assert sorted(resumed) == [1, 2, 3, 4] and {s: resumed[s] for s in (1, 2)} == first


def test_auto_without_a_checkpoint_or_without_resume_is_this_machines_choice(tmp_path, monkeypatch):
    """``load_run_config`` with the trainer's ``run_precision``: no checkpoint, checkpoint.resume=never, an unreadable
    checkpoint config or one with fp16, or a GPU: the run's precision is not consulted; without ``run_precision``
    (other tools) neither."""
    from pretrain.config import load_run_config
    from pretrain.training.resume import run_precision

    def load(overrides):
        return load_run_config(None, overrides, run_precision=run_precision)

    run = tmp_path / "run"
    tag = run / "checkpoints" / "step_00000002"
    _cpu(monkeypatch, tmp_path, NO_AMX)
    assert load([f"run_dir={run}", "train.precision=auto"]).train.precision == "fp32"
    tag.mkdir(parents=True)
    (tag / "trainer_state.json").write_text("{}")
    (tag / "config.yaml").write_text("train:\n  precision: bf16\n")
    assert load([f"run_dir={run}", "train.precision=auto"]).train.precision == "bf16"
    assert load([f"run_dir={run}", "train.precision=fp32"]).train.precision == "fp32"
    assert load([f"run_dir={run}", "train.precision=auto", "checkpoint.resume=never"]).train.precision == "fp32"
    for text in ("- not a mapping\n", "train: [1, 2\n", "train:\n  precision: fp16\n"):
        (tag / "config.yaml").write_text(text)
        assert load([f"run_dir={run}", "train.precision=auto"]).train.precision == "fp32", text
    (tag / "config.yaml").write_text("train:\n  precision: bf16\n")
    assert load_run_config(None, [f"run_dir={run}", "train.precision=auto"]).train.precision == "fp32"  # not asked
    cfg = load([f"run_dir={run}", "train.precision=auto"])
    assert cfg.train.precision == "bf16"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert run_precision(cfg, "bf16") is None
