"""model/banded.py: sliding-window attention over the band only equals SDPA with the dense window mask (float64,
outputs and gradients of every real query), with and without padding, at lengths that are and are not whole
blocks; the encoders' two paths (padded and unpadded) give the same output whether the band is used or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.config.model import ModelConfig
from pretrain.model import banded, build_model
from pretrain.model.banded import make_band, use_band
from pretrain.model.packing import pack
from pretrain.model.rotary import window_mask


@pytest.mark.parametrize("bsz,heads,length,size,half,padded", [
    (2, 3, 37, 8, 4, False), (2, 3, 37, 8, 4, True), (1, 2, 64, 4, 16, True), (3, 2, 10, 4, 3, True),
    (2, 2, 130, 8, 64, True), (2, 1, 9, 4, 1, True), (2, 2, 10, 8, 64, True), (1, 1, 5, 4, 8, False)])
def test_band_equals_the_dense_window_in_float64(bsz, heads, length, size, half, padded):
    g = torch.Generator().manual_seed(length + half)
    q, k, v = (torch.randn(bsz, heads, length, size, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    keep_B11T = None
    if padded:
        lengths = torch.randint(1, length + 1, (bsz,), generator=g)
        lengths[0] = length
        keep_B11T = (torch.arange(length)[None] < lengths[:, None])[:, None, None, :]
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(keep_B11T, length, half, q.device))
    band = make_band(keep_B11T, length, half, q.device)
    got = banded.banded_attention(q, k, v, band)
    assert got.shape == dense.shape and torch.isfinite(got).all()
    real_B1T1 = (torch.ones(bsz, 1, length, 1, dtype=torch.bool) if keep_B11T is None
                 else keep_B11T[:, :, 0, :, None])
    torch.testing.assert_close(got * real_B1T1, dense * real_B1T1, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(dense.shape, generator=g, dtype=torch.float64) * real_B1T1  # padding rows: never read
    want = torch.autograd.grad((dense * upstream).sum(), (q, k, v))
    grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_band_is_used_only_from_several_blocks_on():
    assert not use_band(128, 64) and not use_band(320, 64) and use_band(321, 64) and use_band(8192, 64)
    assert not use_band(1000, 0)


def test_encoder_gives_the_same_output_with_and_without_the_band(monkeypatch):
    cfg = ModelConfig(arch="modernbert", vocab_size=60, hidden_size=32, num_heads=4, ffn_size=48, num_layers=3,
                      local_window=8, pooler=False, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    lengths = [45, 30, 7, 45]
    ids_BT = torch.randint(4, 60, (len(lengths), max(lengths)))
    mask_BT = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    ids_BT = ids_BT * mask_BT
    packed = pack([(ids_BT.numpy(), mask_BT.numpy())])
    keep = mask_BT.bool()[..., None]
    outs = {}
    for min_blocks in (banded.MIN_BLOCKS, 10**9):  # the band (45 > 5 * 4), then the dense mask everywhere
        monkeypatch.setattr(banded, "MIN_BLOCKS", min_blocks)
        with torch.no_grad():
            padded = model.encode(ids_BT, mask_BT)
            unpadded = model.encoder(ids_BT, mask_BT, packed=packed)
        outs[min_blocks] = (padded * keep, unpadded)
    (band_p, band_u), (dense_p, dense_u) = outs.values()
    torch.testing.assert_close(band_p, dense_p, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(band_u, dense_u, rtol=1e-10, atol=1e-10)
    assert (band_p - dense_p).abs().max() < 1e-10 and band_u.shape == (sum(lengths), 32)


def test_training_through_the_band_with_attention_dropout_gives_finite_gradients():
    """Train mode (dropout inside the blocked SDPA), padded and unpadded: finite loss and gradients, and the
    dropout really acts (two forwards differ)."""
    cfg = ModelConfig(arch="modernbert", vocab_size=60, hidden_size=32, num_heads=4, ffn_size=48, num_layers=2,
                      local_window=8, global_every=2, pooler=False, dropout=0.0, attention_dropout=0.5)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    lengths = [45, 12, 33]
    ids_BT = torch.randint(4, 60, (3, 45))
    mask_BT = (torch.arange(45)[None] < torch.tensor(lengths)[:, None]).long()
    packed = pack([(ids_BT.numpy(), mask_BT.numpy())])
    for run in (lambda: model.encode(ids_BT, mask_BT)[mask_BT.bool()], lambda: model.encoder(ids_BT, mask_BT,
                                                                                             packed=packed)):
        model.zero_grad()
        first, second = run(), run()
        assert not torch.equal(first, second)
        (first.square().mean() + second.square().mean()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert model.encoder.layers[1].attn.qkv.weight.grad.abs().sum() > 0  # layer 1 is local: the band
