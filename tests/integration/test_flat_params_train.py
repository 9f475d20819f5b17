"""train.flat_params through the trainer (real DeepSpeed, ZeRO-2, 1 rank): the flat run trains the per-tensor run's
model (losses at fp32 rounding: the fused q/k/v matmul may block its sums otherwise), its checkpoint's
model.safetensors has the per-tensor names, and a run whose checkpoint was written per tensor (every checkpoint
from before train.flat_params) resumes in that layout when the config asks for flat parameters, bitwise; likewise a
checkpoint flat a layer (train.flat_scope=layer, every flat checkpoint from before train.flat_scope) under the
default one pair for the encoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train_resume import _kill_at_first_checkpoint, _losses, _run

ZERO2 = {"distributed__zero_stage": 2}


@pytest.fixture(scope="module")
def per_tensor_run(tmp_path_factory, tiny_overrides) -> Path:
    """A whole 8-step per-tensor run (train.flat_params=false, ZeRO-2): the flat run's reference, and the uncut run
    whose losses the per-tensor checkpoint's resume must give (one run for both tests)."""
    run_dir = tmp_path_factory.mktemp("per_tensor")
    code, out = _run(tiny_overrides(run_dir, train__flat_params="false", **ZERO2), nproc=1)
    assert code == 0, out[-3000:]
    return run_dir


def test_flat_and_per_tensor_runs_train_the_same_model(tmp_path, tiny_overrides, per_tensor_run):
    runs = {"per_tensor": per_tensor_run, "flat": tmp_path / "flat"}
    code, out = _run(tiny_overrides(runs["flat"], train__flat_params="true", **ZERO2), nproc=1)
    assert code == 0, out[-3000:]
    a, b = _losses(runs["flat"]), _losses(runs["per_tensor"])
    assert sorted(a) == list(range(1, 9)) and sorted(b) == sorted(a)
    for step in a:
        assert math.isclose(a[step], b[step], rel_tol=1e-5), (step, a[step], b[step])
    for step in (4, 8):
        tags = {n: d / "checkpoints" / f"step_{step:08d}" for n, d in runs.items()}
        assert (tags["flat"] / "flat_layout.json").is_file() and not (tags["per_tensor"] / "flat_layout.json").exists()
        layout = json.loads((tags["flat"] / "flat_layout.json").read_text())
        assert set(layout) == {f"model.encoder.layers.flat_{k}" for k in ("decay", "no_decay")}  # flat_scope=encoder
        wa, wb = load_file(tags["flat"] / "model.safetensors"), load_file(tags["per_tensor"] / "model.safetensors")
        assert wa.keys() == wb.keys() and "encoder.layers.1.attn.q.weight" in wa
        for k in wa:
            assert wa[k].shape == wb[k].shape, k
            assert (wa[k] - wb[k]).abs().max() <= 1e-4 * max(1.0, float(wb[k].abs().max())), (step, k)


def _resumed(tmp_path, tiny_overrides, old: dict, new: dict, ref_dir: Path | None = None) -> tuple[Path, str]:
    """A run written with the ``old`` overrides, cut at its first checkpoint and resumed with ``new``: its run
    directory and the resume's output; its losses are asserted equal to the uncut ``old`` run's (``ref_dir``, run
    here if not given), bitwise."""
    cut_dir = tmp_path / "cut"
    if ref_dir is None:
        ref_dir = tmp_path / "ref"
        code, out = _run(tiny_overrides(ref_dir, **old), nproc=1)
        assert code == 0, out[-3000:]
    _kill_at_first_checkpoint(tiny_overrides(cut_dir, **old), cut_dir, nproc=1)
    code, out = _run(tiny_overrides(cut_dir, **new), nproc=1)
    assert code == 0, out[-3000:]
    assert _losses(cut_dir) == _losses(ref_dir)
    return Path(cut_dir), out


def test_a_per_tensor_checkpoint_resumes_in_its_layout(tmp_path, tiny_overrides, per_tensor_run):
    cut_dir, out = _resumed(tmp_path, tiny_overrides, {"train__flat_params": "false", **ZERO2},
                            {"train__flat_params": "true", **ZERO2}, ref_dir=per_tensor_run)  # asks for flat
    assert "holds the encoder layers' parameters per-tensor (train.flat_params=false): this run continues so" in out
    assert not (cut_dir / "checkpoints" / "step_00000008" / "flat_layout.json").exists()


def test_a_checkpoint_flat_a_layer_resumes_in_its_layout(tmp_path, tiny_overrides):
    cut_dir, out = _resumed(tmp_path, tiny_overrides, {"train__flat_scope": "layer", **ZERO2},
                            ZERO2)  # the default scope, encoder
    assert "holds the encoder layers' parameters flat with train.flat_scope=layer: this run continues so" in out
    layout = json.loads((cut_dir / "checkpoints" / "step_00000008" / "flat_layout.json").read_text())
    assert "model.encoder.layers.1.flat_decay" in layout
