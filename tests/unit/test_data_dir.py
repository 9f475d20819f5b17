"""One rule for the shared data: an explicit directory, else $PRETRAIN_DATA_DIR, else ../shared/data (from the
working directory, then beside the repository), for pretrain-eval, pretrain-finetune-glue and eval.stsb_every."""

from __future__ import annotations

import pytest

from pretrain.config import load_run_config
from pretrain.eval import find_data_dir
from pretrain.training.evaluation import stsb_data_dir


def _shared(root):
    (root / "sts" / "STSBenchmark").mkdir(parents=True)
    (root / "glue").mkdir()
    return root


def test_env_then_default_and_the_error_names_every_place(tmp_path, monkeypatch):
    env_dir = _shared(tmp_path / "env")
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(env_dir))
    assert find_data_dir(need="glue") == str(env_dir)
    assert find_data_dir(str(tmp_path), need="") == str(tmp_path)  # explicit wins
    # $PRETRAIN_DATA_DIR set but wrong: no silent fallback, and the error says where it looked.
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"looked in: .*nowhere/glue \(\$PRETRAIN_DATA_DIR\)"):
        find_data_dir(need="glue", what="GLUE data")
    # Unset: ../shared/data from the working directory.
    monkeypatch.delenv("PRETRAIN_DATA_DIR")
    work = tmp_path / "repo"
    work.mkdir()
    _shared(tmp_path / "shared" / "data")
    monkeypatch.chdir(work)
    assert find_data_dir(need="sts/STSBenchmark") == "../shared/data"


def test_stsb_every_finds_the_data_like_the_tools(tmp_path, monkeypatch):
    """eval.stsb_every follows the same rule: $PRETRAIN_DATA_DIR without eval.data_dir; a wrong eval.data_dir is
    an error naming the path it tried."""
    env_dir = _shared(tmp_path / "env")
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(env_dir))
    cfg = load_run_config(None, ["eval.stsb_every=10"])
    assert stsb_data_dir(cfg.eval, 2) == str(env_dir)
    cfg = load_run_config(None, ["eval.stsb_every=10", f"eval.data_dir={tmp_path / 'x'}"])
    with pytest.raises(FileNotFoundError, match=r"eval.stsb_every: STS-B dev not found; looked in: .*x/sts/STSBenchmark"):
        stsb_data_dir(cfg.eval, 2)


def test_tools_say_where_they_looked(tmp_path, monkeypatch, capsys):
    from pretrain.eval import cli, glue_cli

    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(tmp_path), "--suites", "sts"])
    assert e.value.code == 2 and "nowhere/sts ($PRETRAIN_DATA_DIR)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        glue_cli.main(["--model", str(tmp_path), "--tasks", "rte", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "nowhere/glue ($PRETRAIN_DATA_DIR)" in capsys.readouterr().err
