"""data.packing=full with span masking, end to end: train, SIGKILL after the first checkpoint, resume -> the same
losses bitwise (the sample index across documents and the per-sample masking depend only on the data and keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_resume import _kill_at_first_checkpoint, _losses, _run


@pytest.mark.slow
def test_full_packing_and_span_masking_resume_bitwise(tmp_path, tiny_overrides, tiny_corpus):
    extra = {"data__packing": "full", "data__masking__scheme": "span", "data__num_workers": 1}
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    code, out = _run(tiny_overrides(ref_dir, **extra), nproc=1)
    assert code == 0, out[-3000:]
    ref = _losses(ref_dir)
    assert sorted(ref) == list(range(1, 9))
    assert list((Path(tiny_corpus["train"]) / "index-cache").glob("samples-*-full1-*.npy"))  # cached, shared
    _kill_at_first_checkpoint(tiny_overrides(cut_dir, **extra), cut_dir, nproc=1)
    code, out = _run(tiny_overrides(cut_dir, **extra), nproc=1)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(cut_dir) == ref
