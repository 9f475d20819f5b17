"""model.arch=modernbert: the encoder computes transformers' ModernBERT (weights from a ModernBertForMaskedLM that
transformers initialised itself, eager and sdpa attention, padded batches longer than the local window), the
unpadded path equals the padded one (rotary on packed position ids, window composed with the groups' masks), the
config checks and the size presets."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pretrain.config import load_run_config  # noqa: E402
from pretrain.config.model import ModelConfig  # noqa: E402
from pretrain.export import hf as hfmod  # noqa: E402
from pretrain.model import TIED_KEYS, build_model  # noqa: E402
from pretrain.model.packing import pack  # noqa: E402
from pretrain.model.rotary import apply_rope, rope_tables, window_mask  # noqa: E402

TINY = dict(arch="modernbert", vocab_size=60, hidden_size=32, num_heads=4, ffn_size=48, num_layers=4, local_window=8,
            pooler=False, layer_norm_eps=1e-5)


def _hf_modernbert(transformers, impl: str, seed: int = 0):
    """A ModernBertForMaskedLM initialised by transformers itself (window 8, global every 3rd layer, rope bases
    that differ from the defaults so that a swap would show)."""
    torch.manual_seed(seed)
    c = transformers.ModernBertConfig(
        vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        local_attention=8, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        cls_token_id=2, sep_token_id=3, max_position_embeddings=256, global_rope_theta=1000.0,
        local_rope_theta=50.0, attn_implementation=impl)
    return transformers.ModernBertForMaskedLM(c).eval()


def _padded_batch(lengths, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids_BT = torch.randint(4, vocab, (len(lengths), t), generator=g)
    mask_BT = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()
    return ids_BT * mask_BT, mask_BT


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_matches_transformers_modernbert(impl):
    transformers = pytest.importorskip("transformers")
    hf = _hf_modernbert(transformers, impl)
    cfg = hfmod.model_config_from_hf_config(hf.config.to_dict())
    assert (cfg.arch, cfg.local_window, cfg.global_every, cfg.rope_theta, cfg.rope_theta_local) == (
        "modernbert", 8, 3, 1000.0, 50.0)
    model = hfmod.model_with_state(cfg, hfmod.from_hf_state_dict(hf.state_dict(), cfg.num_layers, "modernbert"),
                                   source="test").eval()
    ids_BT, mask_BT = _padded_batch([40, 25, 9, 1])  # longer than the window, padding past a window's reach
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        logits_MV, _ = model.mlm_logits(h_BTD, torch.where(keep_BT, ids_BT, -100))
        ref = hf(input_ids=ids_BT, attention_mask=mask_BT)
        ref_h_BTD = hf.model(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
    assert (h_BTD - ref_h_BTD)[keep_BT].abs().max() < 1e-5
    assert (logits_MV - ref.logits[keep_BT]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["BHTK", "NHK"])
def test_rope_and_its_written_out_backward(layout):
    """apply_rope (its autograd Function: the gradient rotated back) against the formula in float64 with autograd's
    own backward; bf16 in, bf16 out."""
    g = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(torch.arange(11) * 3, 16, 500.0, torch.float32)
    shape = (2, 3, 11, 16) if layout == "BHTK" else (11, 3, 16)
    if layout == "NHK":
        cos, sin = cos[:, None], sin[:, None]
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(*shape, generator=g)
    y = apply_rope(x, cos, sin)
    (grad,) = torch.autograd.grad(y, x, w)
    x64 = x.detach().double().requires_grad_()
    half = 8
    rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    ref = x64 * cos.double() + rotated * sin.double()
    (ref_grad,) = torch.autograd.grad(ref, x64, w.double())
    assert (y - ref).abs().max() < 1e-5 and (grad - ref_grad).abs().max() < 1e-5
    xb = x.detach().bfloat16().requires_grad_()
    yb = apply_rope(xb, cos, sin)
    (gb,) = torch.autograd.grad(yb, xb, w.bfloat16())
    assert yb.dtype == gb.dtype == torch.bfloat16
    assert (yb.double() - ref).abs().max() < 0.05 and (gb.double() - ref_grad).abs().max() < 0.05



def test_rope_in_fp32_for_an_attention_that_computes_in_fp32(monkeypatch):
    """apply_rope(x_bf16, ..., torch.float32): the rotation of the bf16 input not rounded to bf16 (float64 formula
    within fp32 rounding), its gradient back in bf16; ``attention`` takes those fp32 q and k with a bf16 v, computes
    as it does for bf16 inputs (the same mask) and where a tensor is too small for its own path casts them to bf16
    for SDPA, as before."""
    from pretrain.model import dropout as dropout_module
    from pretrain.model.dropout import attention, attention_dtype

    g = torch.Generator().manual_seed(4)
    cos, sin = rope_tables(torch.arange(12), 16, 500.0, torch.bfloat16)
    assert cos.dtype == torch.float32 and torch.equal(cos, cos.bfloat16().float())  # rounded, held in fp32
    x = torch.randn(2, 3, 12, 16, generator=g).bfloat16().requires_grad_()
    y = apply_rope(x, cos, sin, torch.float32)
    w = torch.randn(y.shape, generator=g)
    (grad,) = torch.autograd.grad(y, x, w)
    x64 = x.detach().double().requires_grad_()
    ref = x64 * cos.double() + torch.cat((-x64[..., 8:], x64[..., :8]), dim=-1) * sin.double()
    (ref_grad,) = torch.autograd.grad(ref, x64, w.double())
    assert y.dtype == torch.float32 and (y - ref).abs().max() < 1e-5
    assert (apply_rope(x, cos, sin).double() - ref).abs().max() > 1e-3  # the bf16 output is rounded
    assert grad.dtype == torch.bfloat16 and (grad.double() - ref_grad).abs().max() < 0.05
    assert attention_dtype(x, 0.1) == torch.float32
    assert attention_dtype(x, 0.0) == attention_dtype(x, 0.1, fast=False) == torch.bfloat16
    assert attention_dtype(x.float(), 0.1) == torch.float32
    q, k = y.detach(), torch.randn(y.shape, generator=g)
    v = torch.randn(y.shape, generator=g).bfloat16()
    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 0)  # this module's own path
    torch.manual_seed(5)
    out = attention(q, k, v, None, 0.1)
    torch.manual_seed(5)
    ref_fp32 = attention(q, k, v.float(), None, 0.1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_fp32.bfloat16())
    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 1 << 40)  # every tensor small: SDPA, on bf16 q and k
    torch.manual_seed(6)
    out = attention(q, k, v, None, 0.1)
    torch.manual_seed(6)
    ref_sdpa = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v, dropout_p=0.1)
    assert torch.equal(out, ref_sdpa)


@pytest.mark.parametrize("c_kernel", [False, True])
def test_a_bf16_cpu_step_casts_q_and_k_once_each(monkeypatch, c_kernel):
    """A bf16 ModernBERT training step on the CPU (unpadded, fast dropout): RoPE writes q and k in fp32 for the
    attention, so per attention group and layer neither is rounded to bf16 and cast back, nor are their gradients:
    seven casts fewer per group and layer than with RoPE writing bf16 (the old way, ``attention_dtype`` patched)
    on torch's path; four with the C kernel, which reads and writes either dtype itself (so RoPE's own casts are
    gone from both arms, and the attention's remain in the old one)."""
    from test_trim_last_layer import _batch, _module

    from pretrain.metrics.op_count import OpCounter
    from pretrain.model import dropout as dropout_module
    from pretrain.model import modern_block, rotary
    from pretrain.training.step import host_facts

    module = _module(False, dropout=0.1, attention_dropout=0.1, **{**TINY, "vocab_size": 50}).bfloat16()
    module.train()
    batch = host_facts(_batch(), unpadded=True)
    groups = len(batch["packed_mlm"].groups) + len(batch["packed_views"].groups)

    def casts() -> int:
        torch.manual_seed(0)
        with OpCounter() as c:
            module(batch)[0].float().backward()
        return c.ops.get("aten._to_copy", 0)

    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 0)  # the tiny model's tensors take the fast path
    if not c_kernel:
        monkeypatch.setattr(rotary, "cpu_kernels", lambda: None)
    elif rotary.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    now = casts()
    monkeypatch.setattr(modern_block, "attention_dtype", lambda x, p, fast=True: x.dtype)
    before = casts()
    layers = TINY["num_layers"]
    # forward: the rotated pair's cast to bf16 (torch's path) and attention's two casts back; backward: q's and
    # k's gradients cast to bf16 for RoPE and back to fp32 in it (torch's path)
    assert before - now >= (4 if c_kernel else 7) * groups * layers, (before, now, groups)


@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_rope_of_queries_and_keys_in_one_call(layout):
    """apply_rope_qk: q and k with their own tables (the queries' scaled) in one autograd node; for a fused
    projection's q and k (one strided block) one rotation over both (``rotary._joint``), for separate tensors
    two. Outputs and gradients against the float64 formula; in bf16 with fp32 out as attention takes them."""
    from pretrain.model import rotary

    n, t, h, k = 3, 10, 4, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(n * t, 3 * h * k, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(torch.arange(t), k, 500.0, torch.float64)
    cos_2, sin_2 = torch.stack((cos / 4, cos))[:, None, None], torch.stack((sin / 4, sin))[:, None, None]
    for dtype, out in ((torch.float32, None), (torch.bfloat16, torch.float32)):
        base = qkv.to(dtype).requires_grad_()
        z = base.view(n, t, 3, h, k)
        q, key = (z[:, :, i].transpose(1, 2) for i in (0, 1))
        if layout == "separate":
            q, key = q.contiguous(), key.clone()
        assert (rotary._joint(q, key) is None) == (layout == "separate")
        rq, rk = rotary.apply_rope_qk(q, key, cos_2, sin_2, out)
        assert rq.dtype == rk.dtype == (out or dtype) and rq.is_contiguous() and rk.is_contiguous()
        wq, wk = torch.randn(rq.shape, generator=g), torch.randn(rk.shape, generator=g)
        (grad,) = torch.autograd.grad((rq.double() * wq).sum() + (rk.double() * wk).sum(), base)
        x64 = base.detach().double().requires_grad_()
        z64 = x64.view(n, t, 3, h, k)
        refs = [rotary.apply_rope(z64[:, :, i].transpose(1, 2), cos_2[i, 0, 0], sin_2[i, 0, 0]) for i in (0, 1)]
        (ref_grad,) = torch.autograd.grad((refs[0] * wq).sum() + (refs[1] * wk).sum(), x64)
        tol = 1e-5 if dtype == torch.float32 else 0.05
        assert (rq.double() - refs[0]).abs().max() < 1e-5 and (rk.double() - refs[1]).abs().max() < 1e-5
        assert grad.dtype == dtype and (grad.double() - ref_grad).abs().max() < tol


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_gated_gelus_written_out_backward(approximate):
    """GeGLU's gelu(u) * g with its backward written into one gradient (``modern_block._GatedGelu``): value and
    gradient against autograd's chunk, gelu and product in float64, a non-contiguous input included; in bf16 the
    same dtype out and back."""
    import torch.nn.functional as F

    from pretrain.model.modern_block import _GatedGelu

    g = torch.Generator().manual_seed(2)
    z = torch.randn(20, 2 * 12, dtype=torch.float64, generator=g)[:, None].expand(20, 3, 24).requires_grad_()
    w = torch.randn(20, 3, 12, dtype=torch.float64, generator=g)
    y = _GatedGelu.apply(z, approximate)
    (grad,) = torch.autograd.grad(y, z, w)
    u, gate = z.chunk(2, dim=-1)
    ref = F.gelu(u, approximate=approximate) * gate
    (ref_grad,) = torch.autograd.grad(ref, z, w)
    assert (y - ref).abs().max() < 1e-15 and (grad - ref_grad).abs().max() < 1e-14
    zb = z.detach().bfloat16().requires_grad_()
    yb = _GatedGelu.apply(zb, approximate)
    (gb,) = torch.autograd.grad(yb, zb, w.bfloat16())
    assert yb.dtype == gb.dtype == torch.bfloat16 and (gb.double() - ref_grad).abs().max() < 0.05

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_gelu_in_c(dtype):
    """The C kernel's GeGLU (CPU, erf's GELU, fp32/bf16): value and gradient against the float64 formula, over
    u from -12 to 12 (where gelu(u) underflows towards 0 and where it is u), a non-contiguous input included; only
    z is saved for the backward. fp32 within a few roundings of each term; bf16 within its rounding."""
    import torch.nn.functional as F

    from pretrain.model import modern_block
    from pretrain.model.modern_block import _GatedGelu

    if modern_block.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(4)
    rows = 1100  # x 2 x 60: 132k elements, which the kernel splits over 2 threads
    u = torch.cat([torch.linspace(-12, 12, 3000), torch.randn(rows * 60 - 3000, generator=gen) * 3]).view(rows, 60)
    gate = torch.randn(rows, 60, generator=gen)
    z64 = torch.cat([u, gate], -1).double()
    w = torch.randn(rows, 60, dtype=torch.float64, generator=gen)
    z = z64.to(dtype)[:, None].expand(rows, 2, 120).requires_grad_()  # strided: made contiguous inside
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = _GatedGelu.apply(z, "none")
    assert saved == [torch.Size([rows, 2, 120])] and y.dtype == dtype
    (grad,) = torch.autograd.grad(y, z, w[:, None].expand(rows, 2, 60).to(dtype))
    zr = z.detach().double().requires_grad_()
    ur, gr = zr.chunk(2, dim=-1)
    ref = F.gelu(ur) * gr
    (ref_grad,) = torch.autograd.grad(ref, zr, w[:, None].expand(rows, 2, 60))
    eps = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    scale_y = (ur.abs() * gr.abs()).detach() + 1e-30
    assert ((y.double() - ref).abs() <= 8 * eps * scale_y).all()
    # du = dh g (Phi(u) + u phi(u)), dg = dh u Phi(u): each within a few roundings of its terms' sizes
    dh = w[:, None].expand(rows, 2, 60)
    scale_g = torch.cat([(dh * gr.detach()).abs() * (1 + ur.detach().abs()), (dh * ur.detach()).abs()], -1) + 1e-30
    assert ((grad.double() - ref_grad).abs() <= 8 * eps * scale_g).all()


def test_rope_writes_head_major_views_contiguous_so_attention_copies_nothing():
    """q and k come as (n, H, t, K) views of the fused projection's (n, t, H, K) memory: RoPE's output is contiguous
    (head-major), so the attention's matmuls fold (n, H) without a copy; the values are the view's rotation."""
    from pretrain.metrics.op_count import OpCounter
    from pretrain.model.dropout import attention

    n, t, h, k = 3, 10, 4, 16
    qkv = torch.randn(n * t, 3 * h * k, generator=torch.Generator().manual_seed(0))
    q, key = (qkv[:, i * h * k:(i + 1) * h * k].view(n, t, h, k).permute(0, 2, 1, 3) for i in (0, 1))
    cos, sin = rope_tables(torch.arange(t), k, 500.0, torch.float32)
    rq, rk = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    assert rq.is_contiguous() and rk.is_contiguous()
    assert torch.equal(rq, apply_rope(q.contiguous(), cos, sin))
    with OpCounter() as c:
        attention(rq, rk, rk, None, 0.0)
    assert not {op for op in c.ops if op.split(".")[1] in ("clone", "contiguous", "copy_")}, c.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_v_is_copied_once_for_the_forward_and_the_backward(dtype, monkeypatch):
    """v stays a view of the fused projection's slots (RoPE rewrites q and k only). With the CPU's dropout path
    (``dropout.attention`` past SDPA) it is made contiguous once, so the backward's grad v^T multiplies that copy
    (matmul copied the view apart in the forward and again in the backward); SDPA (no dropout) takes the view as
    it is. Output and gradients are those of a contiguous v's."""
    from pretrain.metrics.op_count import OpCounter
    from pretrain.model import dropout as dropout_module

    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 0)  # these small tensors take the C path too
    n, t, h, k = 3, 10, 4, 16
    qkv = torch.randn(n * t, 3 * h * k, generator=torch.Generator().manual_seed(1)).to(dtype)
    keep = torch.ones(n, 1, 1, t, dtype=torch.bool)
    keep[1, ..., 7:] = False

    def run(p, contiguous_v):
        q, key, v = (qkv[:, i * h * k:(i + 1) * h * k].view(n, t, h, k).permute(0, 2, 1, 3) for i in range(3))
        q, key = q.float().contiguous(), key.float().contiguous()  # RoPE's output (fp32 with dropout)
        v = v.contiguous() if contiguous_v else v  # the slots' strided view, or a contiguous copy
        leaves = [z.detach().requires_grad_(True) for z in (q, key, v)]
        torch.manual_seed(3)
        with OpCounter() as forward:
            y = dropout_module.attention(*leaves, keep, p)
        with OpCounter() as backward:
            grads = torch.autograd.grad((y.float() ** 2).sum(), leaves)
        return y, grads, [sum(n for op, n in c.ops.items() if op.split(".")[1] == "clone") for c in (forward, backward)]

    y, grad, clones = run(0.1, False)
    y0, grad0, _ = run(0.1, True)
    assert torch.equal(y, y0) and all(torch.equal(a, b) for a, b in zip(grad, grad0))
    assert clones == [1, 0]  # the one copy, forward
    assert run(0.0, False)[2] == [0, 0]  # SDPA: no copy


def test_key_table_both_ways_is_exact():
    transformers = pytest.importorskip("transformers")
    hf = _hf_modernbert(transformers, "sdpa", seed=1)
    hf_state = hf.state_dict()
    ours = hfmod.from_hf_state_dict(hf_state, 4, "modernbert")
    back = hfmod.to_hf_state_dict(ours, 4, "modernbert")
    assert set(back) == set(hf_state) - {"decoder.weight"}  # tied to the word embeddings
    assert all(torch.equal(back[k], hf_state[k]) for k in back)
    model = build_model(ModelConfig(**TINY), seed=0)
    expected = {k for k in model.state_dict() if k not in TIED_KEYS and not k.startswith("projection.")}
    assert set(ours) == expected
    base = {k.removeprefix("model."): v for k, v in back.items() if k.startswith("model.")}
    assert set(base) == set(hf.model.state_dict())  # ModernBertModel's own names
    assert hfmod.from_hf_state_dict(base, 4, "modernbert").keys() == {k for k in ours if k.startswith("encoder.")}


def test_unpadded_equals_padded():
    model = build_model(ModelConfig(**TINY, dropout=0.0, attention_dropout=0.0), seed=1).eval()
    ids_BT, mask_BT = _padded_batch([40, 3, 17, 40, 9, 25, 1], seed=2)
    packed = pack([(ids_BT.numpy(), mask_BT.numpy())])
    assert len(packed.groups) > 1  # several groups, some masked
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        h_ND = model.encode(None, None, packed=packed)
        assert (h_BTD.flatten(0, 1)[packed.index_N] - h_ND).abs().max() < 1e-5
        for pooling in ("cls", "mean"):
            e_BD = model.pool(h_ND, None, pooling, packed=packed)
            assert (model.pool(h_BTD, mask_BT, pooling) - e_BD).abs().max() < 1e-5
    model.train()
    model.encode(None, None, packed=packed).square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_window_mask_keeps_padding_rows_finite():
    keep_B11T = torch.tensor([[1, 1, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    mask = window_mask(keep_B11T, 6, 1, torch.device("cpu"))[0, 0]
    assert mask[0].tolist() == [True, True, False, False, False, False]
    assert mask[5].tolist() == [True, True, False, False, False, False]  # padding query: every real key
    assert mask.any(-1).all()
    assert window_mask(None, 3, 2, torch.device("cpu")) is None  # the window covers the whole sequence


def test_layers_global_every_n_and_bias_free():
    model = build_model(ModelConfig(**TINY), seed=0)
    assert [layer.is_global for layer in model.encoder.layers] == [True, False, False, True]
    assert model.encoder.layers[0].attn_norm is None
    names = [n for n, _ in model.named_parameters() if not n.startswith("projection.")]
    assert [n for n in names if n.endswith(".bias")] == ["mlm_head.bias"]  # the decoder's, as ModernBERT's


def test_modernbert_init_is_truncated_and_scales_the_residual_writers():
    cfg = ModelConfig(**{**TINY, "hidden_size": 64, "ffn_size": 256})
    model = build_model(cfg, seed=0)
    again = build_model(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    for layer in model.encoder.layers:
        for w, s in ((layer.attn.qkv.weight, 0.02), (layer.ffn.wi.weight, 0.02), (layer.attn.out.weight, out_std),
                     (layer.ffn.wo.weight, out_std)):
            assert w.abs().max() <= 2 * s and 0.7 * s < w.std() < s, (w.shape, float(w.std()), s)
    assert model.encoder.embeddings.word.weight.abs().max() <= 0.04
    assert all(float(p.min()) == float(p.max()) == 1.0 for n, p in model.named_parameters() if "norm" in n)


def test_config_checks():
    with pytest.raises(ValueError, match="model.pooler must be false"):
        ModelConfig(arch="modernbert")
    with pytest.raises(ValueError, match="model.arch must be"):
        ModelConfig(arch="gpt", pooler=False)
    with pytest.raises(ValueError, match="even head size"):
        ModelConfig(**{**TINY, "hidden_size": 12, "num_heads": 4})


@pytest.mark.parametrize("name,sizes", [
    ("modernbert-base", (22, 768, 12, 1152)),
    ("modernbert-large", (28, 1024, 16, 2624)),
    ("modernbert-mini", (4, 256, 4, 384)),
    ("modernbert-tiny", (3, 128, 2, 256)),
])
def test_size_presets(name, sizes):
    m = load_run_config(None, [f"model={name}"]).model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.ffn_size) == sizes
    assert (m.arch, m.local_window, m.global_every, m.rope_theta, m.rope_theta_local) == (
        "modernbert", 128, 3, 160000.0, 10000.0)
    if name in ("modernbert-base", "modernbert-large"):
        transformers = pytest.importorskip("transformers")
        ref = transformers.ModernBertConfig()  # ModernBERT-base's published settings are its defaults
        assert (ref.local_attention, ref.norm_eps, ref.max_position_embeddings) == (
            m.local_window, m.layer_norm_eps, m.max_position)
        if name == "modernbert-base":
            assert (ref.num_hidden_layers, ref.hidden_size, ref.num_attention_heads, ref.intermediate_size) == sizes


@pytest.mark.slow
def test_8192_tokens_padded_packed_and_transformers_agree(one_thread):
    """The published context: a sequence of 8,192 tokens next to one of 3,000 (padded), through ours padded, ours
    unpadded and transformers' ModernBertModel (sdpa) with the same weights."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(arch="modernbert", pooler=False, vocab_size=100, hidden_size=16, num_layers=3, num_heads=2,
                      ffn_size=24, max_position=8192, layer_norm_eps=1e-5)
    model = build_model(cfg, seed=0).eval()
    ids_BT, mask_BT = _padded_batch([8192, 3000], vocab=100)
    d = hfmod.hf_config_from_model_config(cfg, None, "BertModel")
    hf = transformers.ModernBertModel(transformers.ModernBertConfig(
        **{k: v for k, v in d.items() if k not in ("pretrain", "architectures", "model_type")},
        attn_implementation="sdpa")).eval()
    state = hfmod.to_hf_state_dict({k: v for k, v in model.state_dict().items() if k not in TIED_KEYS}, 3,
                                   "modernbert")
    hf.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    packed = pack([(ids_BT.numpy(), mask_BT.numpy())])
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        assert (h_BTD.flatten(0, 1)[packed.index_N] - model.encode(None, None, packed=packed)).abs().max() < 1e-5
        ref_BTD = hf(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
    assert (h_BTD - ref_BTD)[keep_BT].abs().max() < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_rope_in_c_is_the_formula(in_dtype, out_dtype, monkeypatch):
    """The C kernel's rotation (``rotary._rotate`` on the CPU) for the layouts the model hands it: a fused
    projection's q and k as one strided (2, n, H, t, K) view with stacked tables (the queries' scaled), one
    head-major view with (t, K) tables, a packed (N, H, K) tensor with (N, 1, K) tables; forward and inverse.
    Against the float64 formula within fp32's rounding (the cos product rounded, then one rounding of the sum),
    and within one unit of the last place of torch's path (bit for bit where torch's kernel fuses the
    multiply-add, as on this project's x86 machines)."""
    from pretrain.model import rotary

    if rotary.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(31)
    cos, sin = rope_tables(torch.arange(37), 64, 10000.0, torch.float32)
    big_cos, big_sin = rope_tables(torch.arange(1100), 64, 10000.0, torch.float32)
    z = torch.randn(3, 37, 3, 4, 64, generator=gen).to(in_dtype)
    q, k = z[:, :, 0].transpose(1, 2), z[:, :, 1].transpose(1, 2)
    cases = [(rotary._joint(q, k), torch.stack([cos * 0.125, cos])[:, None, None],
              torch.stack([sin * 0.125, sin])[:, None, None]),
             (q, cos, sin),
             (torch.randn(37, 4, 64, generator=gen).to(in_dtype), cos[:, None], sin[:, None]),
             # 1,100 tokens: 282k elements, which the kernel splits over 2 threads
             (torch.randn(1100, 4, 64, generator=gen).to(in_dtype), big_cos[:, None], big_sin[:, None])]
    assert cases[0][0] is not None
    empty = torch.empty(0, 4, 37, 64).to(in_dtype)  # an empty tensor: an empty result, no division by a zero size
    assert rotary._rotate(empty, cos, sin, 1.0, out_dtype).shape == empty.shape
    for x, c, s in cases:
        for sign in (1.0, -1.0):
            y = rotary._rotate(x, c, s, sign, out_dtype)
            assert y.dtype == out_dtype and y.is_contiguous() and y.shape == x.shape
            x64, c64, s64 = x.double(), c.double().expand(x.shape), s.double().expand(x.shape)
            rot = torch.cat([-x64[..., 32:], x64[..., :32]], -1)
            exact = x64 * c64 + sign * rot * s64
            bound = (x64 * c64).abs() + (rot * s64).abs()
            ulp = 2.0 ** -23 if out_dtype == torch.float32 else 2.0 ** -8
            assert ((y.double() - exact).abs() <= 2 * ulp * bound + 1e-30).all()
            with monkeypatch.context() as m:
                m.setattr(rotary, "cpu_kernels", lambda: None)
                ref = rotary._rotate(x, c, s, sign, out_dtype)
            assert ((y.double() - ref.double()).abs() <= ulp * ref.double().abs()).all()
