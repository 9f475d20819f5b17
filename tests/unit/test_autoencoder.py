"""SARCSE TextCNN autoencoder: shapes (incl. sentences shorter than the kernels), a loop-written
float64 reference of the whole forward pass, padding invariance and gradient flow."""

from __future__ import annotations

import pytest
import torch

from pretrain.model.autoencoder import TextCNNAutoencoder, content_tokens

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _ae(hidden=6, kernels=(3, 4, 5), channels=7, integ=3, seed=0) -> TextCNNAutoencoder:
    torch.manual_seed(seed)
    return TextCNNAutoencoder(hidden, kernel_sizes=kernels, channels=channels, integrate_channels=integ).double()


def _lengths_mask(lengths, width):
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()


def _reference_row(ae: TextCNNAutoencoder, x_TD: torch.Tensor):
    """One sentence of n valid tokens, by explicit loops over windows, channels and kernel taps."""
    n, _ = x_TD.shape
    H, argmax = [], []
    for ks, conv in zip(ae.kernel_sizes, ae.text_cnns):
        xp = torch.cat([x_TD, x_TD.new_zeros(max(n, ks) - n, x_TD.shape[1])])  # pad short sentences to ks
        W, b = conv.weight, conv.bias  # [C, D, ks], [C]
        acts = []
        for t in range(xp.shape[0] - ks + 1):
            a = b.clone()
            for j in range(ks):
                a = a + W[:, :, j] @ xp[t + j]
            acts.append(torch.relu(a))
        acts = torch.stack(acts, 1)  # [C, L]
        h, idx = acts.max(1)
        H.append(h)
        argmax.append(idx)
    H = torch.stack(H)  # [K, C]
    K, C = H.shape
    Wi, bi = ae.integrate.weight, ae.integrate.bias  # [co_c, 1, K, 2]
    Z = torch.stack([
        torch.stack([bi[c] + sum(Wi[c, 0, r, s] * H[r, u + s] for r in range(K) for s in range(2))
                     for u in range(C - 1)])
        for c in range(ae.integrate_channels)
    ])  # [co_c, C-1]
    We, be = ae.expand.weight, ae.expand.bias  # [co_c, 1, K, 2]
    Hr = torch.zeros(K, C, dtype=F64) + be[0]
    for c in range(ae.integrate_channels):
        for u in range(C - 1):
            for r in range(K):
                for s in range(2):
                    Hr[r, u + s] = Hr[r, u + s] + We[c, 0, r, s] * Z[c, u]
    recon = []
    for k, (ks, dec) in enumerate(zip(ae.kernel_sizes, ae.text_decoders)):
        Wd, bd = dec.weight, dec.bias  # [C, D, ks], [D]
        out = torch.zeros(n, Wd.shape[1], dtype=F64) + bd
        for ch in range(C):
            a = int(argmax[k][ch])
            for j in range(ks):
                if a + j < n:
                    out[a + j] = out[a + j] + Wd[ch, :, j] * Hr[k, ch]
        recon.append(out)
    return Z.flatten(), torch.stack(recon).mean(0)


@torch.no_grad()
def test_forward_matches_loop_reference_incl_short_sentences():
    ae = _ae()
    lengths = [9, 4, 2, 1]  # 4 < 5 and 2, 1 < 3: shorter than the kernels
    x = torch.randn(4, 9, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    mask = _lengths_mask(lengths, 9)
    z, recon = ae(x, mask)
    assert z.shape == (4, ae.embed_dim) and recon.shape == x.shape
    for b, n in enumerate(lengths):
        z_ref, r_ref = _reference_row(ae, x[b, :n])
        torch.testing.assert_close(z[b], z_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(recon[b, :n], r_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ae.embed(x, mask), z)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 11])
def test_shapes_for_every_width(width):
    ae = _ae(hidden=8, channels=500)
    assert ae.embed_dim == 3 * 499  # SARCSE: Z in R^{co_c * (co_t - 1)}
    x = torch.randn(2, width, 8, dtype=F64)
    z, recon = ae(x, torch.ones(2, width))
    assert z.shape == (2, 1497) and recon.shape == (2, width, 8)
    assert torch.isfinite(z).all() and torch.isfinite(recon).all()


def test_padding_does_not_leak():
    ae = _ae()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 6, dtype=F64, generator=g)
    mask = _lengths_mask([8, 5], 8)
    z, recon = ae(x, mask)
    x2 = x.clone()
    x2[1, 5:] = 100 * torch.randn(3, 6, dtype=F64, generator=g)  # garbage in the padding
    z2, recon2 = ae(x2, mask)
    torch.testing.assert_close(z2, z)
    torch.testing.assert_close(recon2[1, :5], recon[1, :5])
    # the same sentence alone in a narrower batch gives the same result
    z_alone, recon_alone = ae(x[1:, :5], torch.ones(1, 5))
    torch.testing.assert_close(z_alone[0], z[1])
    torch.testing.assert_close(recon_alone[0], recon[1, :5])


@pytest.mark.parametrize("width", [2, 12])
def test_gradient_reaches_every_parameter_and_the_input(width):
    ae = _ae(channels=16)
    x = torch.randn(3, width, 6, dtype=F64, requires_grad=True)
    mask = _lengths_mask([width, max(1, width - 1), 1], width)
    z, recon = ae(x, mask)
    loss = z.pow(2).sum() + ((recon - x) ** 2 * mask[..., None]).sum()
    loss.backward()
    for name, p in ae.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_content_tokens_drops_cls_and_sep():
    ids = torch.tensor([[101, 7, 8, 9, 102], [101, 5, 102, 0, 0]])
    mask = (ids != 0).long()
    h = torch.arange(10.0).view(2, 5, 1).expand(2, 5, 3)
    hc, mc, ic = content_tokens(h, mask, ids)
    assert ic.tolist() == [[7, 8, 9], [5, 102, 0]]
    assert mc.tolist() == [[True, True, True], [True, False, False]]
    assert hc[0, :, 0].tolist() == [1.0, 2.0, 3.0] and hc.shape == (2, 3, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel"):
        TextCNNAutoencoder(8, kernel_sizes=(), channels=4)
    with pytest.raises(ValueError, match="channels"):
        TextCNNAutoencoder(8, channels=1)


@torch.no_grad()
def test_z_embedding_is_the_loop_reference_over_each_sentences_content_tokens():
    """SARCSE's inference embedding (``ZEmbedding``, pooling autoencoder_z; pretrain-eval and eval.stsb_every): per
    sentence of a right-padded batch of unequal lengths, the float64 loop reference's Z over that sentence's own
    encoder states with [CLS] and [SEP] dropped (the padding and the batch's other rows change nothing)."""
    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model
    from pretrain.model.autoencoder import AUTOENCODER_Z, ZEmbedding

    model = build_model(ModelConfig(vocab_size=50, hidden_size=6, num_layers=2, num_heads=2, ffn_size=12,
                                    max_position=32, dropout=0.0, attention_dropout=0.0), seed=1).double().eval()
    ae = _ae(hidden=6)
    embed = ZEmbedding(model, ae)
    assert not embed.training  # keeps the model's mode
    lengths = [9, 4, 3, 7]  # 3: one content token, shorter than every kernel
    ids_BT = torch.randint(5, 50, (len(lengths), max(lengths)))
    mask_BT = _lengths_mask(lengths, max(lengths))
    ids_BT = ids_BT * mask_BT
    z_BE = embed.pool(embed.encode(ids_BT, mask_BT), mask_BT, AUTOENCODER_Z)
    assert z_BE.shape == (len(lengths), ae.embed_dim)
    for b, n in enumerate(lengths):
        h_TD = model.encode(ids_BT[b:b + 1, :n], mask_BT[b:b + 1, :n])[0]
        want, _ = _reference_row(ae, h_TD[1:n - 1])
        torch.testing.assert_close(z_BE[b], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="autoencoder_z"):
        embed.pool(h_TD[None], mask_BT[:1, :n], "cls")


def test_autoencoder_from_state_reads_its_shape_from_the_weights():
    """The autoencoder a checkpoint keeps in heads.safetensors comes back with its kernel sizes and channels (read
    from the tensors) and computes what the trained one did; weights of something else are a ValueError."""
    from pretrain.model.autoencoder import autoencoder_from_state

    ae = _ae(hidden=6, kernels=(2, 3), channels=5, integ=2).float()
    state = {f"heads.autoencoder.{k}": v for k, v in ae.state_dict().items()}
    back = autoencoder_from_state({**state, "heads.other.weight": torch.zeros(1)})
    assert (back.kernel_sizes, back.channels, back.integrate_channels) == ((2, 3), 5, 2)
    x_BTD, mask_BT = torch.randn(3, 6, 6), _lengths_mask([6, 2, 4], 6)
    torch.testing.assert_close(back.embed(x_BTD, mask_BT), ae.embed(x_BTD, mask_BT), rtol=0, atol=0)
    assert autoencoder_from_state({"encoder.x": torch.zeros(1)}) is None
    del state["heads.autoencoder.integrate.weight"]
    with pytest.raises(ValueError, match="SARCSE TextCNN autoencoder"):
        autoencoder_from_state(state)
