"""Golden curve: the first 20 per-step losses and grad norms of a fixed tiny run, stored in the repo.

A change that moves them changes what training computes (data order, masking, views, init, dropout,
the loss, the optimizer step). Such a change must update the asset on purpose and say why in its commit:

    PRETRAIN_UPDATE_GOLDEN=1 python3 -m pytest tests/integration/test_golden_curve.py

Everything is generated here, independent of the Python version and of tokenizer training: a corpus of
made-up words from a fixed linear congruential generator and a WordPiece vocabulary listing exactly
those words. Tolerances absorb only CPU-kernel differences between machines (1e-4 relative); a
changed dropout mask, sample, masking or update moves the losses by far more.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

ASSET = Path(__file__).resolve().parents[1] / "assets" / "golden_tiny.json"
OLD_RUN_DIR = ASSET.parent / "run_dir_format3"
STEPS = 20
REL_TOL = {"loss": 1e-4, "mlm": 1e-4, "nt_xent": 1e-4, "grad_norm": 1e-3}


def _lcg(seed: int):
    state = seed
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        yield state >> 33


def _corpus(path: Path) -> list[str]:
    """~2,000 sentences over 300 made-up lower-case words (Zipf-like frequencies), documents of 20 lines."""
    rnd = _lcg(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(letters[next(rnd) % 26] for _ in range(3 + next(rnd) % 6)) for _ in range(300)})
    lines = []
    for i in range(2000):
        n = 6 + next(rnd) % 14
        sent = [words[min(len(words) - 1, int(len(words) * (next(rnd) % 10_000 / 10_000) ** 2))] for _ in range(n)]
        lines.append(" ".join(sent).capitalize() + ".")
        if i % 20 == 19:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return words


def _tokenizer(words: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    from pretrain.prep.tokenizer import SPECIAL_TOKENS, _post_processor

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, ".", *words])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = _post_processor()
    tok.save(str(path))


def _overrides(tmp_path: Path, run_dir: Path) -> list[str]:
    """The golden run's data (made here, identical on every machine) and settings."""
    from pretrain.prep.preprocess import preprocess

    words = _corpus(tmp_path / "corpus.txt")
    _tokenizer(words, tmp_path / "tokenizer.json")
    preprocess([str(tmp_path / "corpus.txt")], str(tmp_path / "data"), str(tmp_path / "tokenizer.json"), num_workers=1)
    overrides = {
        "run_dir": run_dir, "seed": 7, "data.tokenizer": tmp_path / "tokenizer.json",
        "data.sources": f"[{{name: golden, path: {tmp_path / 'data'}}}]", "data.valid": "[]",
        "data.max_len": 48, "data.view_max_len": 24, "data.num_workers": 0,
        "data.augment.methods": "del-span+reorder",
        "model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "model.ffn_size": 64,
        "model.max_position": 64, "model.pooling": "mean", "model.dropout": 0.1,
        "train.micro_batch_size": 8, "train.max_steps": STEPS, "train.log_every": 1,
        "optim.lr": 1e-3, "optim.warmup_steps": 5, "checkpoint.every": 0, "distributed.zero_stage": 0,
        # The padded reference path with every token's last layer, two passes and torch's dropout: the stored
        # curve and the old run directory predate train.unpadded, train.trim_last_layer, train.joint_pass (which
        # also acts on the padded path) and train.fast_dropout, whose dropout draws other noise;
        # tests/unit/test_unpadded.py, test_trim_last_layer.py, test_joint_pass.py and test_fast_dropout.py hold
        # those paths to this one.
        "train.unpadded": "false", "train.trim_last_layer": "false", "train.joint_pass": "false",
        "train.fast_dropout": "false",
    }
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    return [str(config), *(f"{k}={v}" for k, v in overrides.items())]


def _train_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in REL_TOL} for r in rows if r.get("split", "train") == "train" and "loss" in r}


def _run(tmp_path: Path) -> dict[int, dict]:
    from pretrain.train import main

    run_dir = tmp_path / "run"
    assert main(_overrides(tmp_path, run_dir)) == 0
    return _train_rows(run_dir)


def _assert_golden(got: dict[int, dict], steps) -> None:
    want = {int(s): v for s, v in json.loads(ASSET.read_text()).items()}
    for step in steps:
        for key, tol in REL_TOL.items():
            a, b = got[step][key], want[step][key]
            assert math.isclose(a, b, rel_tol=tol), (
                f"step {step} {key}: {a!r} != golden {b!r}. If training is meant to change, regenerate "
                f"with PRETRAIN_UPDATE_GOLDEN=1 and say why in the commit.")


def test_golden_curve(tmp_path, clean_env):
    got = _run(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    if os.environ.get("PRETRAIN_UPDATE_GOLDEN"):
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        ASSET.write_text(json.dumps({str(s): v for s, v in sorted(got.items())}, indent=1) + "\n")
        pytest.skip(f"golden curve rewritten: {ASSET}")
    assert sorted(json.loads(ASSET.read_text()), key=int) == [str(s) for s in sorted(got)]
    _assert_golden(got, sorted(got))


def test_run_dir_from_before_the_trainer_house_resumes_on_the_curve(tmp_path, clean_env):
    """A run directory written by pretrain 15d45cf (trainer_state format 3; the golden run with checkpoint.every=10,
    kept at its step-10 checkpoint) resumes with today's code and continues the golden curve: steps 11-20 equal
    the uninterrupted run's — with every setting docs/operations.md calls free changed at the resume."""
    from pretrain.train import main

    run_dir = tmp_path / "run"
    shutil.copytree(OLD_RUN_DIR, run_dir)
    free = ["train.eval_every=5", "train.eval_batches=3", "train.max_bad_steps=7", "checkpoint.every=3",
            "checkpoint.every_minutes=600", "checkpoint.background=false", "checkpoint.keep_last=2", "checkpoint.trust=true", "checkpoint.resume=auto", "data.num_workers=1",
            "data.prefetch_factor=3", "data.timeout_s=900",
            "distributed.timeout_s=300", "distributed.peer_timeout_s=100",
            "ops.similarity=eager", "ops.chunk_size=5", "eval.max_len=64", "eval.keep_best=false",
            "train.malloc_mmap_threshold_kib=128", "train.malloc_trim_chunks=false"]
    assert main([*_overrides(tmp_path, run_dir), *free]) == 0
    got = _train_rows(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # steps 1-10 from the old run's metrics.jsonl, 11-20 new
    _assert_golden(got, range(11, STEPS + 1))
