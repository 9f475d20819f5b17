"""The MLM decoder computed in vocabulary chunks on the CPU (model/heads.py: decoder_logits): the same logits and
gradients as one ``F.linear``, against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.model import heads
from pretrain.model.heads import DECODER_CHUNK, _ChunkedDecoder, decoder_logits


def _inputs(dtype, vocab: int, rows: int = 37, dim: int = 24):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, dim, generator=gen, dtype=torch.float64)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64)
    g = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, g)]


def _grads(fn, x, w, b, g):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = fn(x, w, b)
    out.backward(g)
    return out.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_chunked_logits_and_gradients_match_one_linear_in_float64(dtype, tol):
    vocab = 2 * DECODER_CHUNK + 77  # a last chunk shorter than the others
    x, w, b, g = _inputs(dtype, vocab)
    calls = []
    apply = _ChunkedDecoder.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    _ChunkedDecoder.apply = counted
    try:
        ours = _grads(decoder_logits, x, w, b, g)
    finally:
        _ChunkedDecoder.apply = apply
    assert calls, "the chunked path did not run"
    ref = _grads(F.linear, *(t.double() for t in (x, w, b, g)))
    for name, a, r in zip(("logits", "x", "w", "b"), ours, ref):
        assert a.dtype == dtype
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < tol, (name, err)


def test_the_chunks_cover_every_column_once(monkeypatch):
    """With a chunk that does not divide the vocabulary, each logit equals its own dot product (a column written
    twice or skipped would hold another's value or garbage)."""
    monkeypatch.setattr(heads, "DECODER_CHUNK", 7)
    x, w, b, _ = _inputs(torch.float64, vocab=45)
    got = decoder_logits(x, w, b)
    want = torch.stack([x @ w[v] + b[v] for v in range(45)], dim=1)
    assert (got - want).abs().max().item() < 1e-12


def test_small_vocabularies_and_autocast_take_linear():
    x, w, b, _ = _inputs(torch.float32, vocab=DECODER_CHUNK)
    seen = []
    apply = _ChunkedDecoder.apply
    _ChunkedDecoder.apply = lambda *a: seen.append(1) or apply(*a)
    try:
        decoder_logits(x, w, b)  # one chunk: nothing to split
        x2, w2, b2, _ = _inputs(torch.float32, vocab=2 * DECODER_CHUNK)
        with torch.autocast("cpu", torch.bfloat16):
            out = decoder_logits(x2, w2, b2)
        assert out.dtype == torch.bfloat16  # autocast's own linear
        assert not seen
        decoder_logits(x2, w2, b2)
        assert seen
    finally:
        _ChunkedDecoder.apply = apply
