"""objective.gradient_cache end to end on 2 gloo ranks (ZeRO-2, grad_accum 2, dropout on): train, SIGKILL after the
first checkpoint, resume -> the same losses bitwise. Each chunk's dropout is keyed by (seed, step, rank, chunk), so
a resume replays nothing; the data position is the uncached step's."""

from __future__ import annotations

import json

import pytest
from test_train_resume import _kill_at_first_checkpoint, _losses, _run


@pytest.mark.slow
def test_cached_run_killed_and_resumed_reproduces_losses_bitwise(tmp_path, tiny_overrides):
    extra = {"objective__gradient_cache": "true", "train__micro_batch_size": 2, "train__grad_accum": 2}
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    code, out = _run(tiny_overrides(ref_dir, **extra), nproc=2)
    assert code == 0, out[-3000:]
    ref = _losses(ref_dir)
    assert sorted(ref) == list(range(1, 9))
    rec = json.loads((ref_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert all(k in rec for k in ("mlm", "nt_xent", "cl_acc", "cl_emb_cos")), rec

    _kill_at_first_checkpoint(tiny_overrides(cut_dir, **extra), cut_dir, nproc=2)
    code, out = _run(tiny_overrides(cut_dir, **extra), nproc=2)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(cut_dir) == ref  # bitwise: same floats, every step
