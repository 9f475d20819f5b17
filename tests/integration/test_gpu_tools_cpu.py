"""The GPU pass's own logic, dry-run on the CPU: `tools/gpu_smoke.py` (train, resume a copy from the
half-way checkpoint, compare the losses) and `tools/bench_step.py`'s FLOP count and table.

The GPU pass runs only where a GPU is lent (tools/gpu_check.sh); these keep its scripts working in
between, so that the next lent GPU is not spent on a broken script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gpu_smoke_dry_run_on_cpu(tmp_path, clean_env):  # clean_env: no launcher variables leak in
    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_smoke.py"), str(out), "--only", "matrix", "--zero-stages", "2",
         "--precisions", "fp32", "--similarity", "torch", "--steps", "20", "--parallel", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "smoke.json").read_text())
    (run,) = summary["matrix"]
    assert run["rc"] == 0 and run["resume"]["resumed_msg"]
    # The resumed copy continues from step 10 exactly as the uninterrupted run (CPU: bitwise).
    assert run["resume"]["steps_compared"] == [20]
    assert run["resume"]["max_rel_diff"] == 0.0
    assert run["valid_mlm"][0][0] == 0 and run["valid_mlm"][-1][0] == 20 and run["loss_falls"]


def test_bench_step_flop_count_matches_hand_count():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import bench_step
    finally:
        sys.path.pop(0)
    d, f, layers, vocab = 768, 3072, 12, 30522
    per_token = lambda t: layers * (24 * d * d + 4 * t * d)  # noqa: E731 - f = 4d: 8d^2 + 4df = 24d^2
    fwd = 128 * per_token(128) + 2 * 64 * per_token(64) + 0.15 * 128 * (2 * d * d + 2 * d * vocab)
    assert f == 4 * d
    assert bench_step.train_flops_per_sample("base", 128, 64, vocab) == pytest.approx(3 * fwd, rel=1e-12)
