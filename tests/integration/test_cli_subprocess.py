"""The CLIs as real subprocesses (the rest of the bad-input suite runs them in-process: tests/unit/test_bad_inputs.py)."""

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
    (["-m", "pretrain.data.preprocess", "--verify", "/nonexistent/ds"], 1, ["/nonexistent/ds does not exist"]),
])
def test_real_cli_subprocess(cmd, code, words):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    r = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-2000:]
    for w in words:
        assert w in r.stdout + r.stderr
