"""Bad inputs stop `pretrain-train` before DeepSpeed starts: every check on paths, names, the tokenizer and data
compatibility runs first. The proof: the run gets a `deepspeed` that raises when imported, and must still fail
with its own one-line error (exit 2), never with DeepSpeed's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POISON = "deepspeed was imported before the inputs were checked"


@pytest.fixture(scope="module")
def poisoned_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("poison")
    (d / "deepspeed").mkdir()
    (d / "deepspeed" / "__init__.py").write_text(f"raise ImportError({POISON!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PRETRAIN_DATA_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(d), str(REPO), os.environ.get("PYTHONPATH", "")])
    return env


def _other_tokenizer(tmp_path: Path) -> str:
    from pretrain.prep.tokenizer import train_tokenizer

    text = tmp_path / "other.txt"
    text.write_text("\n\n".join(f"Another corpus line number {i} with words." for i in range(200)))
    out = tmp_path / "other" / "tokenizer.json"
    train_tokenizer([str(text)], str(out), vocab_size=120, min_frequency=1)
    return str(out)


CASES = {
    "dataset path": (["data.sources=[{{name: x, path: /nonexistent/dataset}}]"], "/nonexistent/dataset"),
    "augmentation name": (["data.augment.methods=del-spam"], "del-spam"),
    "tokenizer mismatch": (["data.tokenizer={other}"], "tokenizer"),
    # $PRETRAIN_DATA_DIR (set below to a directory without sts/) is then the only place looked at.
    "stsb without data": (["eval.stsb_every=5"], "eval.data_dir"),
    "stsb data dir missing": (["eval.stsb_every=5", "eval.data_dir=/nonexistent/sts"], "/nonexistent/sts"),
    "stsb under zero-3": (["eval.stsb_every=5", "eval.data_dir={repo}", "distributed.zero_stage=3"], "zero_stage"),
    "init_from missing": (["checkpoint.init_from=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    "teacher missing": (["objective.rank_distill={{teachers: [/nonexistent/teacher]}}", "objective.consistency={{}}",
                         "objective.info_nce={{}}", "data.stage=sentences", "data.sentences={sentences}"],
                        "/nonexistent/teacher"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_before_deepspeed_starts(case, tmp_path, tiny_overrides, tiny_corpus, poisoned_env):
    extra, fragment = CASES[case]
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(f"A sentence number {i}." for i in range(50)))
    fill = {"other": _other_tokenizer(tmp_path) if case == "tokenizer mismatch" else "", "repo": str(REPO),
            "sentences": str(sentences)}
    argv = [sys.executable, "-m", "pretrain.train", *tiny_overrides(tmp_path / "run"),
            *[e.format(**fill) for e in extra]]
    t0 = time.perf_counter()
    env = dict(poisoned_env, PRETRAIN_DATA_DIR=str(tmp_path)) if case == "stsb without data" else poisoned_env
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    err = proc.stderr.strip()
    assert POISON not in err, f"{case}: checked only after DeepSpeed was imported:\n{err[-2000:]}"
    assert proc.returncode == 2, f"{case}: exit {proc.returncode}\n{err[-2000:]}"
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err
    print(f"{case}: failed in {took:.1f} s: {err}")
