"""The CLIs and launch scripts as real subprocesses (the bad-input suite runs the CLIs in-process:
tests/unit/test_bad_inputs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("cmd, code, words", [
    (["-m", "pretrain.train", "optim.lrr=1"], 2, ["unknown config key(s) optim.lrr"]),
    (["-m", "pretrain.prep.preprocess", "--verify", "/nonexistent/ds"], 1, ["/nonexistent/ds does not exist"]),
])
def test_real_cli_subprocess(cmd, code, words):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    r = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-2000:]
    for w in words:
        assert w in r.stdout + r.stderr


def test_glue_sbatch_passes_array_index(tmp_path, repo_root):
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/bash\necho "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    script = str(repo_root / "slurm" / "finetune_glue.sbatch")
    out = subprocess.run(["bash", script, "--tasks", "rte", "--out", "x"], env={**env, "SLURM_ARRAY_TASK_ID": "3"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["python", "-m", "pretrain.eval.glue_cli", "--tasks", "rte", "--out", "x",
                           "--run-index", "3"]
    env.pop("SLURM_ARRAY_TASK_ID", None)
    assert subprocess.run(["bash", script], env=env, capture_output=True).returncode == 2
