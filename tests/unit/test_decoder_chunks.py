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
    ours = _grads(_ChunkedDecoder.apply, x, w, b, g)
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
    got = _ChunkedDecoder.apply(x, w, b)
    want = torch.stack([x @ w[v] + b[v] for v in range(45)], dim=1)
    assert (got - want).abs().max().item() < 1e-12


def test_the_decoder_is_chunked_in_float32_on_the_cpu_only(monkeypatch):
    """decoder_logits takes the chunks for a float32 vocabulary of two chunks or more, eagerly and without autocast;
    F.linear otherwise (one chunk, other dtypes, autocast)."""
    seen = []
    apply = _ChunkedDecoder.apply
    monkeypatch.setattr(_ChunkedDecoder, "apply", lambda *a: seen.append(1) or apply(*a))
    x, w, b, _ = _inputs(torch.float32, vocab=2 * DECODER_CHUNK)
    decoder_logits(*_inputs(torch.float32, vocab=DECODER_CHUNK)[:3])  # one chunk: nothing to split
    decoder_logits(*_inputs(torch.float64, vocab=2 * DECODER_CHUNK)[:3])
    decoder_logits(*_inputs(torch.bfloat16, vocab=2 * DECODER_CHUNK)[:3])
    with torch.autocast("cpu", torch.bfloat16):
        assert decoder_logits(x, w, b).dtype == torch.bfloat16  # autocast's own linear
    assert not seen
    got = decoder_logits(x, w, b)
    assert seen == [1]
    assert (got - F.linear(x, w, b)).abs().max().item() < 1e-4
