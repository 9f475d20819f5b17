"""The command-line end of pretrain-train: ``cli`` ends the process itself (no interpreter teardown, where c10d's
threads can abort a finished distributed run), so it must hand back main's exit code and every line main printed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pretrain.train import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("make", ["empty run dir", "missing dir"])
def test_cli_exits_with_mains_code_and_loses_no_output_on_a_pipe(tmp_path, capsys, make):
    run = tmp_path / "run"
    if make == "empty run dir":
        run.mkdir()
    expected_code = main(["--check", str(run)])
    expected = capsys.readouterr()
    assert expected.out or expected.err  # main said something: the comparison below can fail
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # stdout/stderr are pipes here (block-buffered): every line main wrote must still arrive.
    proc = subprocess.run([sys.executable, "-m", "pretrain.train", "--check", str(run)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == expected_code
    assert (proc.stdout, proc.stderr) == (expected.out, expected.err)


def test_the_console_script_goes_through_cli():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts["pretrain-train"] == "pretrain.train:cli"
