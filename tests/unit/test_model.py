"""PretrainModel: equivalence with transformers' BertModel, MLM head on masked rows, tying, gradients,
padding invariance, pooling. Shapes: B batch, T length, D hidden, V vocab, M masked positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config.model import ModelConfig
from pretrain.export.hf import hf_config_from_model_config, to_hf_state_dict
from pretrain.model import TIED_KEYS, build_model

TINY = ModelConfig(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=40)


def _batch(gen: torch.Generator, b: int = 3, t: int = 11, vocab: int = 101):
    ids_BT = torch.randint(0, vocab, (b, t), generator=gen)
    lengths = [t, t - 4, 3][:b]
    mask_BT = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask_BT[i, :n] = 1
    return ids_BT, mask_BT


def _hf_bert(model, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    d = hf_config_from_model_config(model.cfg, None)
    d.pop("pretrain")
    config = transformers.BertConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"  # an independent attention implementation
    hf = transformers.BertForMaskedLM(config).to(dtype).eval()
    state = to_hf_state_dict(model.state_dict(), model.cfg.num_layers)
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    missing, unexpected = hf.load_state_dict({k: v.to(dtype) for k, v in state.items() if not k.startswith("bert.pooler")},
                                             strict=False)  # fmt: skip
    assert not unexpected and all("position_ids" in k or "token_type_ids" in k for k in missing), missing
    return hf


def test_encoder_matches_hf_bert_with_padding():
    torch.manual_seed(0)
    model = build_model(TINY, seed=1).eval()
    hf = _hf_bert(model)
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(2))
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        out = hf(input_ids=ids_BT, attention_mask=mask_BT, output_hidden_states=True)
        layers = model.encode(ids_BT, mask_BT, all_layers=True)
    ref_BTD = out.hidden_states[-1]
    keep = mask_BT.bool()
    assert (h_BTD - ref_BTD)[keep].abs().max() < 1e-5
    assert len(layers) == len(out.hidden_states) == TINY.num_layers + 1
    for ours, ref in zip(layers, out.hidden_states):
        assert (ours - ref)[keep].abs().max() < 1e-5
    # MLM logits on the real tokens agree with BertForMaskedLM's full head.
    labels_BT = torch.where(keep, ids_BT, torch.full_like(ids_BT, -100))
    with torch.no_grad():
        logits_MV, labels_M = model.mlm_logits(h_BTD, labels_BT)
    assert torch.equal(labels_M, ids_BT[keep])
    assert (logits_MV - out.logits[keep]).abs().max() < 1e-4


def test_encoder_matches_float64_reference():
    """fp32 vs our own model in float64 and transformers in float64 (a tighter, independent reference)."""
    model = build_model(TINY, seed=3).eval()
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(4))
    hf64 = _hf_bert(model, torch.float64)
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        ref_BTD = hf64(input_ids=ids_BT, attention_mask=mask_BT, output_hidden_states=True).hidden_states[-1]
    keep = mask_BT.bool()
    assert (h_BTD.double() - ref_BTD)[keep].abs().max() < 1e-5


def test_padding_does_not_change_real_rows():
    model = build_model(TINY, seed=5).eval()
    gen = torch.Generator().manual_seed(6)
    ids_BT = torch.randint(0, 101, (2, 7), generator=gen)
    mask_BT = torch.ones(2, 7, dtype=torch.long)
    pad_ids = torch.cat([ids_BT, torch.randint(0, 101, (2, 5), generator=gen)], dim=1)
    pad_mask = torch.cat([mask_BT, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        h = model.encode(ids_BT, mask_BT)
        hp = model.encode(pad_ids, pad_mask)
        for pooling in ("cls", "cls_before_pooler", "mean"):
            e = model.pool(h, mask_BT, pooling)
            ep = model.pool(hp, pad_mask, pooling)
            assert torch.allclose(e, ep, atol=1e-6), pooling
        e = model.pool(h, mask_BT, "first_last_avg", all_layers=model.encode(ids_BT, mask_BT, all_layers=True))
        ep = model.pool(hp, pad_mask, "first_last_avg", all_layers=model.encode(pad_ids, pad_mask, all_layers=True))
    assert (h - hp[:, :7]).abs().max() < 1e-5
    assert torch.allclose(e, ep, atol=1e-6)


def test_pooling_definitions():
    model = build_model(TINY, seed=7).eval()
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(8))
    with torch.no_grad():
        layers = model.encode(ids_BT, mask_BT, all_layers=True)
        h = layers[-1]
        m = mask_BT.double().unsqueeze(-1)
        mean_ref = (h.double() * m).sum(1) / m.sum(1)
        assert torch.allclose(model.pool(h, mask_BT, "mean").double(), mean_ref, atol=1e-6)
        fl = (layers[1].double() + layers[-1].double()) / 2
        fl_ref = (fl * m).sum(1) / m.sum(1)
        assert torch.allclose(model.pool(h, mask_BT, "first_last_avg", all_layers=layers).double(), fl_ref, atol=1e-6)
        assert torch.equal(model.pool(h, mask_BT, "cls_before_pooler"), h[:, 0])
        w, b = model.pooler.dense.weight.double(), model.pooler.dense.bias.double()
        assert torch.allclose(model.pool(h, mask_BT, "cls").double(), torch.tanh(h[:, 0].double() @ w.T + b), atol=1e-6)
    no_pooler = build_model(dataclasses.replace(TINY, pooler=False), seed=7)
    assert no_pooler.pooler is None and torch.equal(no_pooler.pool(h, mask_BT, "cls"), h[:, 0])
    with pytest.raises(ValueError, match="all_layers"):
        model.pool(h, mask_BT, "first_last_avg")
    with pytest.raises(ValueError, match="unknown pooling"):
        model.pool(h, mask_BT, "max")


def test_mlm_head_on_masked_rows_equals_full_head_gathered():
    model = build_model(TINY, seed=9).eval()
    gen = torch.Generator().manual_seed(10)
    ids_BT, mask_BT = _batch(gen)
    labels_BT = torch.full_like(ids_BT, -100)
    chosen = torch.rand(ids_BT.shape, generator=gen) < 0.3
    labels_BT[chosen] = ids_BT[chosen]
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        logits_MV, labels_M = model.mlm_logits(h_BTD, labels_BT)
        full_BTV = model.mlm_head(h_BTD)
    assert logits_MV.shape == (int(chosen.sum()), TINY.vocab_size)
    assert torch.equal(labels_M, ids_BT[chosen])
    assert torch.allclose(logits_MV, full_BTV[chosen], atol=1e-6)


def test_tying_shares_storage():
    model = build_model(TINY, seed=11)
    word = model.encoder.embeddings.word.weight
    assert model.mlm_head.decoder.weight is word
    sd = model.state_dict()
    for alias, source in TIED_KEYS.items():
        assert sd[alias].data_ptr() == sd[source].data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "mlm_head.decoder.weight" not in names  # one parameter, counted once
    with torch.no_grad():
        word[7].fill_(0.5)
    h_1D = torch.randn(1, TINY.hidden_size)
    x = model.mlm_head.norm(model.mlm_head.act(model.mlm_head.dense(h_1D)))
    assert torch.allclose(model.mlm_head(h_1D)[0, 7], x[0].sum() * 0.5 + model.mlm_head.bias[7], atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_gradient_reaches_every_parameter(norm):
    cfg = dataclasses.replace(TINY, norm=norm, projection_dim=16)
    model = build_model(cfg, seed=12).train()
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(13))
    labels_BT = torch.where(mask_BT.bool(), ids_BT, torch.full_like(ids_BT, -100))
    layers = model.encode(ids_BT, mask_BT, all_layers=True)
    h_BTD = layers[-1]
    assert h_BTD.shape == (3, 11, 32)
    logits_MV, labels_M = model.mlm_logits(h_BTD, labels_BT)
    z_BP = model.project(model.pool(h_BTD, mask_BT, "cls"))
    assert z_BP.shape == (3, 16)
    loss = torch.nn.functional.cross_entropy(logits_MV, labels_M) + z_BP.pow(2).mean()
    loss = loss + model.pool(h_BTD, mask_BT, "first_last_avg", all_layers=layers).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    if norm == "pre":
        assert model.encoder.final_norm is not None


def test_pre_ln_is_a_different_function():
    post = build_model(TINY, seed=14).eval()
    pre = build_model(dataclasses.replace(TINY, norm="pre"), seed=14).eval()
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(15))
    with torch.no_grad():
        h_post, h_pre = post.encode(ids_BT, mask_BT), pre.encode(ids_BT, mask_BT)
    assert h_pre.shape == h_post.shape and torch.isfinite(h_pre).all()
    assert not torch.allclose(h_pre, h_post)


def test_init_and_errors():
    model = build_model(dataclasses.replace(TINY, vocab_size=2000, hidden_size=64, num_heads=4), seed=16)
    w = model.encoder.embeddings.word.weight
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(model.encoder.layers[0].attn.q.bias, torch.zeros(64))
    assert torch.equal(model.encoder.layers[0].attn_norm.weight, torch.ones(64))
    assert torch.equal(model.mlm_head.bias, torch.zeros(2000))
    same = build_model(dataclasses.replace(TINY, vocab_size=2000, hidden_size=64, num_heads=4), seed=16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    with pytest.raises(ValueError, match="vocab_size"):
        build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=4, ffn_size=64))
    with pytest.raises(ValueError, match="max_position"):
        build_model(TINY).encode(torch.zeros(1, 41, dtype=torch.long), torch.ones(1, 41, dtype=torch.long))


def test_attention_dropout_active_only_in_training():
    cfg = dataclasses.replace(TINY, dropout=0.0, attention_dropout=0.5)
    model = build_model(cfg, seed=17)
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(18))
    with torch.no_grad():
        model.eval()
        a, b = model.encode(ids_BT, mask_BT), model.encode(ids_BT, mask_BT)
        model.train()
        c = model.encode(ids_BT, mask_BT)
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_bf16_autocast_runs():
    model = build_model(TINY, seed=19).eval()
    ids_BT, mask_BT = _batch(torch.Generator().manual_seed(20))
    with torch.no_grad():
        h_cpu = model.encode(ids_BT, mask_BT)
        cuda = model.to("cuda")
        assert cuda.mlm_head.decoder.weight is cuda.encoder.embeddings.word.weight  # tie survives .to()
        h_gpu = cuda.encode(ids_BT.cuda(), mask_BT.cuda()).cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h_bf16 = cuda.encode(ids_BT.cuda(), mask_BT.cuda()).float().cpu()
    keep = mask_BT.bool()
    assert (h_cpu - h_gpu)[keep].abs().max() < 1e-4
    assert torch.isfinite(h_bf16).all() and (h_cpu - h_bf16)[keep].abs().max() < 0.1


BUILD_IN_A_FRESH_PROCESS = """
import sys
from pretrain.config.model import ModelConfig
from pretrain.model import build_model
for arch in ("bert", "modernbert"):
    build_model(ModelConfig(arch=arch, vocab_size=100, hidden_size=16, num_layers=3, num_heads=2, ffn_size=32,
                            max_position=32, pooler=arch == "bert"), seed=0)
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes")
             if m in sys.modules))
"""


def test_building_a_model_imports_no_compiler_and_embeddings_init_as_nn_does():
    """build_model builds on the meta device: nn.Embedding's normal_ and to_empty's empty_like there run torch's
    Python reference kernels, which imported torch._dynamo and torch.fx's symbolic shapes (~2.5 s of CPU in every
    process that built a model). Off the meta device the project's Embedding is nn.Embedding, init included."""
    import subprocess
    import sys

    from pretrain.model.embeddings import Embedding

    proc = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
    torch.manual_seed(3)
    ours = Embedding(50, 8, padding_idx=0)
    torch.manual_seed(3)
    theirs = torch.nn.Embedding(50, 8, padding_idx=0)
    assert torch.equal(ours.weight, theirs.weight) and ours.weight.std() > 0.5
    with torch.device("meta"):
        assert Embedding(50, 8).weight.is_meta
