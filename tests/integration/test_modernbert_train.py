"""model.arch=modernbert through the real trainer: MLM + CLEAR on the tiny corpus (unpadded, ZeRO 0), SIGKILL after
the first checkpoint, resume -> the same losses bitwise; ZeRO 2 on the padded path with STS-B dev evaluation (the
pooling/encode path) and keep-best; ``pretrain-convert to-hf`` of the run loads as transformers' ModernBertModel
with our outputs; ZeRO 3 on the unpadded path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_resume import _kill_at_first_checkpoint, _losses, _run

# 3 layers (global, local, local) and a window of 16 tokens, under data.max_len=64: the window acts.
MODERN = {"model__arch": "modernbert", "model__pooler": "false", "model__num_layers": 3, "model__local_window": 16,
          "model__layer_norm_eps": 1e-5, "model__pooling": "mean"}


@pytest.mark.slow
def test_modernbert_mlm_clear_resume_bitwise(tmp_path, tiny_overrides):
    extra = {**MODERN, "distributed__zero_stage": 0}
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    code, out = _run(tiny_overrides(ref_dir, **extra), nproc=1)
    assert code == 0, out[-3000:]
    ref = _losses(ref_dir)
    assert sorted(ref) == list(range(1, 9))
    rec = json.loads((ref_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert "mlm" in rec and "nt_xent" in rec
    _kill_at_first_checkpoint(tiny_overrides(cut_dir, **extra), cut_dir, nproc=1)
    code, out = _run(tiny_overrides(cut_dir, **extra), nproc=1)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(cut_dir) == ref
    from safetensors import safe_open

    with safe_open(str(ref_dir / "checkpoints" / "step_00000008" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "encoder.layers.1.attn.qkv.weight" in keys and "encoder.final_norm.weight" in keys
    assert not any(k.endswith("position.weight") for k in keys)  # rotary: no position table


@pytest.fixture(scope="module")
def single_env():
    """One process group for the module: DeepSpeed caches groups, so it is not re-created per run."""
    from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env

    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    yield env
    destroy_process_group()


@pytest.mark.slow
def test_modernbert_zero2_padded_with_stsb_eval(tmp_path, tiny_overrides, data_dir, single_env):
    """ZeRO 2, train.unpadded=false (the padded reference path), STS-B dev every 2 steps through the run's
    SentenceEncoder (pooling of model.encode) and keep-best."""
    from pretrain.config import load_run_config
    from pretrain.eval.sts import StsbDevEvaluator
    from pretrain.training.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = load_run_config(None, tiny_overrides(
        run_dir, **MODERN, distributed__zero_stage=2, train__unpadded="false", train__max_steps=4,
        checkpoint__every=0, eval__stsb_every=2, eval__data_dir=str(data_dir), eval__max_len=32))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, single_env)
        trainer.stsb.evaluator = StsbDevEvaluator(cfg.eval.data_dir, max_pairs=100)  # CI-sized dev subset
        assert trainer.train() == 0
        trainer.close()
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and "mlm" in r and "nt_xent" in r for r in train)
    assert [r["step"] for r in evals] == [2, 4]
    assert all(-100.0 <= r["stsb_dev_spearman"] <= 100.0 for r in evals)  # Spearman x 100
    assert (Path(run_dir) / "best" / "model.safetensors").is_file()

    transformers = pytest.importorskip("transformers")
    from pretrain.export.convert import main as convert_main
    from pretrain.export.resolve import open_weights

    out = tmp_path / "hf"
    assert convert_main(["to-hf", str(run_dir), str(out)]) == 0
    hf = transformers.AutoModel.from_pretrained(str(out), attn_implementation="sdpa").eval()
    ours = open_weights(run_dir / "checkpoints" / "step_00000004").build_model().eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok(["a short one.", " ".join(["a longer sentence that runs past the local window"] * 4)],
              padding=True, return_tensors="pt")
    assert enc["attention_mask"].sum(1).max() > 16  # model.local_window
    keep_BT = enc["attention_mask"].bool()
    with torch.no_grad():
        h_BTD = ours.encode(enc["input_ids"], enc["attention_mask"])
        ref_BTD = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    assert (h_BTD - ref_BTD)[keep_BT].abs().max() < 1e-5


@pytest.mark.slow
def test_modernbert_zero3_unpadded(tmp_path, tiny_overrides, single_env):
    """ZeRO 3 (parameters partitioned, gathered per module) on the unpadded path; the consolidated weights hold
    the whole modernbert model."""
    from safetensors import safe_open

    from pretrain.config import load_run_config
    from pretrain.training.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = load_run_config(None, tiny_overrides(run_dir, **MODERN, distributed__zero_stage=3, train__max_steps=3,
                                               checkpoint__every=0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, single_env)
        assert trainer.train() == 0
        trainer.close()
    finally:
        torch.set_num_threads(threads)
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in train)
    with safe_open(str(run_dir / "checkpoints" / "step_00000003" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("encoder.layers.2.ffn.wi.weight").shape == (2 * 64, 32)
