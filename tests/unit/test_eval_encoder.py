"""SentenceEncoder: length-sorted batching gives the same embeddings as one-by-one encoding, in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.eval.encoder import (
    SentenceEncoder,
    add_specials,
    length_sorted_batches,
    load_backbone,
)


class WordTokenizer:
    pad_id, cls_id, sep_id = 0, 1, 2

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, 4 + len(self.vocab)) for w in text.split()]


def tiny_model():
    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_position=32,
                      dropout=0.1, attention_dropout=0.1)
    return build_model(cfg, seed=0)


SENTS = ["a b c d e f g", "a", "b c", "d e f g h i j k l m n o", "c c c", "x y"]


@pytest.mark.parametrize("pooling", ["cls", "cls_before_pooler", "mean", "first_last_avg"])
def test_batched_equals_one_by_one(pooling):
    model, tok = tiny_model(), WordTokenizer()
    model.train()
    enc = SentenceEncoder(model, tok, pooling=pooling, max_len=10, batch_size=4)
    got = enc(SENTS)
    assert model.training  # train mode restored
    ref = np.concatenate([enc([s]) for s in SENTS])  # no padding at all
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # independent reference for mean pooling: encode one sentence, average its token states
    if pooling == "mean":
        model.eval()
        with torch.no_grad():
            ids = torch.tensor([add_specials(tok.encode(SENTS[3]), None, tok, 10)[0]])
            h = model.encode(ids, torch.ones_like(ids))
        np.testing.assert_allclose(got[3], h[0].mean(0).numpy(), atol=1e-5)
    assert not np.allclose(got[0], got[1])


def test_specials_and_truncation():
    tok = WordTokenizer()
    ids, types = add_specials([5, 6, 7, 8, 9], None, tok, 4)
    assert ids == [1, 5, 6, 2] and types == [0, 0, 0, 0]
    ids, types = add_specials([5, 6, 7, 8, 9, 10], [11, 12], tok, 8)  # longest-first: a loses 3
    assert ids == [1, 5, 6, 7, 2, 11, 12, 2] and types == [0] * 5 + [1] * 3
    batches = length_sorted_batches([3, 9, 1, 9, 5], 2)
    assert [list(b) for b in batches] == [[1, 3], [4, 0], [2]]


def test_load_backbone_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_backbone(tmp_path / "missing")
    with pytest.raises(ValueError):
        load_backbone(tmp_path, backend="tf")
