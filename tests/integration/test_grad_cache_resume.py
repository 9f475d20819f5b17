"""objective.gradient_cache end to end on 2 gloo ranks (ZeRO-2, grad_accum 2, dropout on): train, then resume a copy
of the run from its first checkpoint -> the same losses bitwise. Each chunk's dropout is keyed by (seed, step, rank,
chunk), so a resume replays nothing; the data position is the uncached step's.

The copy is cut back to that checkpoint (its newer checkpoint and every record after it removed: what a job killed
right after the checkpoint leaves), so the uninterrupted run is also the one that is resumed: two launches, not
three. A job really SIGKILLed after its first checkpoint and relaunched (its lock, its partial files and records
left behind) is test_train_resume.py's two-rank test, on the uncached step."""

from __future__ import annotations

import json
import shutil

import pytest
from test_train_resume import _losses, _run

from pretrain.checkpoint import store


@pytest.mark.slow
def test_cached_run_resumed_from_its_first_checkpoint_reproduces_losses_bitwise(tmp_path, tiny_overrides):
    extra = {"objective__gradient_cache": "true", "train__micro_batch_size": 2, "train__grad_accum": 2}
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    code, out = _run(tiny_overrides(ref_dir, **extra), nproc=2)
    assert code == 0, out[-3000:]
    ref = _losses(ref_dir)
    assert sorted(ref) == list(range(1, 9))
    rec = json.loads((ref_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert all(k in rec for k in ("mlm", "nt_xent", "cl_acc", "cl_emb_cos")), rec

    shutil.copytree(ref_dir, cut_dir)
    ckpt = store.checkpoints_dir(cut_dir)
    assert store.list_complete(ckpt) == ["step_00000004", "step_00000008"]
    shutil.rmtree(ckpt / "step_00000008")
    (ckpt / store.LATEST_FILE).write_text("step_00000004\n")
    metrics = cut_dir / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= 4]
    metrics.write_text("".join(line + "\n" for line in kept))
    assert sorted(_losses(cut_dir)) == [1, 2, 3, 4]

    code, out = _run(tiny_overrides(cut_dir, **extra), nproc=2)
    assert code == 0, out[-3000:]
    assert f"resumed from {ckpt / 'step_00000004'} at step 4" in out, out[-3000:]
    assert _losses(cut_dir) == ref  # bitwise: same floats, every step (5-8 logged by the resumed launch)
