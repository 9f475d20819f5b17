"""train.unpadded: the packed path (model/packing.py) against the padded reference.

Tolerance: both paths run the same fp32 arithmetic per token; only the order of summation differs (attention over
(n, t) blocks instead of (B, T) with masked keys whose probabilities are exactly 0, the mean pool by index_add
instead of a masked bmm, matmul blocking over N rows instead of B*T). Each such sum is within a few ulps
(1.2e-7 relative) times its length (<= 64 terms here) of the other; through two layers and the losses that stays
below 1e-5 of a tensor's largest entry (measured: <= 3e-6), far below what a leak across sequences, a wrong
position or a lost token gives (test_the_comparison_sees_a_leak). Gradients are compared at the scale of their
largest entry, plus 1e-9 absolute: the key bias's gradient is 0 in exact arithmetic (softmax ignores a constant
added to every score of a row), so both paths hold rounding noise of ~1e-11 there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pretrain.config import ModelConfig, ObjectiveConfig, OpsConfig
from pretrain.config.objective import InfoNCEConfig, MLMConfig, NTXentConfig
from pretrain.distributed.env import single_process_env
from pretrain.model import build_model
from pretrain.model.attention import SelfAttention
from pretrain.model.packing import (
    FIXED_GROUPS,
    MAX_GROUPS,
    _exact_cut,
    compute_counts,
    pack,
    plan_fixed,
    plan_groups,
)
from pretrain.objective import Context, Objective, TrainModule
from pretrain.training.step import host_facts

RTOL, ATOL = 1e-5, 1e-6
"""For hidden states and losses (entries of order 1)."""
LENGTHS = [64, 2, 37, 64, 5, 64, 63, 17]
"""Very different lengths in one batch: full rows, a 2-token row, rows one short of full."""


def _model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
                dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**base, **kw})


def _rows(lengths, width, gen, vocab=50, pad_id=0):
    ids = torch.randint(5, vocab, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, pad_id), mask


def _batch(seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids, mask = _rows(LENGTHS, 64, gen)
    labels = torch.where(mask & (torch.rand(mask.shape, generator=gen) < 0.3), ids, -100)
    labels[:, 1] = ids[:, 1]  # every row has a label, the 2-token row too
    view_a, mask_a = _rows([32, 3, 20, 32, 9, 31, 2, 32], 32, gen)
    view_b, mask_b = _rows([30, 4, 32, 11, 9, 2, 25, 32], 32, gen)
    return dict(input_ids=ids, attention_mask=mask, mlm_labels=labels, view_a_ids=view_a, view_a_mask=mask_a,
                view_b_ids=view_b, view_b_mask=mask_b)


def _loss_and_grads(module, batch, unpadded: bool | str, joint: bool = False):
    module.zero_grad(set_to_none=True)
    loss, metrics = module(host_facts(batch, unpadded=unpadded, joint=joint))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v[0] for k, v in metrics.items()}, grads


def _train_module(pooling="cls", mean_mix=0.0, stage="pretrain", **model_kw):
    torch.manual_seed(0)
    model = build_model(_model_cfg(pooling=pooling, **model_kw), seed=0)
    ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling=pooling, view_mean_mix=mean_mix, stage=stage)
    if stage == "sentences":
        cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(gather=False))
    else:
        cfg = ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False))
    return TrainModule(model, Objective(cfg, ctx))


def _assert_same(module, batch, terms, layout="groups", min_grads=20, joint=False):
    loss_p, metrics_p, grads_p = _loss_and_grads(module, batch, unpadded=False)
    loss_u, metrics_u, grads_u = _loss_and_grads(module, batch, unpadded=layout, joint=joint)
    for term in terms:
        torch.testing.assert_close(metrics_u[term], metrics_p[term], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss_u, loss_p, rtol=RTOL, atol=ATOL)
    assert grads_u.keys() == grads_p.keys() and len(grads_p) > min_grads
    for name, g in grads_p.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(grads_u[name], g, rtol=0, atol=RTOL * scale + 1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")


LAYOUTS = ["groups", "varlen", "fixed"]
"""The unpadded path's attention layouts (train.unpadded_attention; varlen is nested-jagged SDPA, on the CPU
torch's math path: the same arithmetic per sequence, so the same tolerance; fixed is the compiled step's groups)."""


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pooling, mean_mix, norm", [("cls", 0.0, "post"), ("cls", 0.5, "pre"),
                                                      ("mean", 0.0, "post")])
def test_losses_and_gradients_equal_the_padded_path(pooling, mean_mix, norm, layout):
    """MLM rows and CLEAR's two views (one pass), [CLS] and mean pooling, post- and pre-LN."""
    _assert_same(_train_module(pooling, mean_mix, norm=norm), _batch(), ("mlm", "nt_xent"), layout)


@pytest.mark.parametrize("layout, joint, trim", [("groups", True, False), ("groups", False, False),
                                                 ("groups", True, True), ("fixed", True, False)])
def test_the_path_off_the_c_kernels_equals_the_padded_path(monkeypatch, layout, joint, trim):
    """The groups' strided q/k/v views and output slots of flat layers (``gather._GroupHeads``,
    ``_HeadsToSlotsStrided``: the eager path on CUDA, forced here by leaving the C kernels out), with and without
    the joint pass, and with the last layer's kept queries (train.trim_last_layer)."""
    from pretrain.model import gather
    from pretrain.model.flat import flatten_layers

    monkeypatch.setattr(gather, "cpu_kernels", lambda: None)
    calls = []
    for fn in (gather._GroupHeads, gather._HeadsToSlotsStrided):
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn.apply, _n=fn.__name__: calls.append(_n) or _f(*a))
    module = _train_module("cls")
    flatten_layers(module.model)
    module.objective.ctx.joint_pass, module.objective.ctx.trim_last_layer = joint, trim
    _assert_same(module, _batch(), ("mlm", "nt_xent"), layout, min_grads=5, joint=joint)
    assert {"_GroupHeads", "_HeadsToSlotsStrided"} <= set(calls), calls


def test_the_varlen_layout_with_flat_layers_and_two_passes_equals_the_padded_path():
    """varlen with the fused q/k/v span of a flattened layer (train.flat_params: strided q, k, v columns), in the
    joint pass (train.joint_pass: the MLM rows and both views as one stream) with the last layer trimmed to the
    rows a loss reads (train.trim_last_layer), and in two passes (each stream with its own layout)."""
    from pretrain.model.flat import flatten_layers

    module = _train_module("cls")
    flatten_layers(module.model)
    module.objective.ctx.joint_pass = module.objective.ctx.trim_last_layer = True  # the last layer for some rows
    _assert_same(module, _batch(), ("mlm", "nt_xent"), "varlen", min_grads=5, joint=True)  # flat: few tensors
    assert all(m.qkv_span is not None for m in module.modules() if isinstance(m, SelfAttention))  # the fused span ran
    module.objective.ctx.joint_pass = False
    _assert_same(module, _batch(1), ("mlm", "nt_xent"), "varlen", min_grads=5)


@pytest.mark.parametrize("pooling, layout", [("cls", "groups"), ("mean", "groups"), ("cls", "fixed")])
def test_modernbert_losses_and_gradients_equal_the_padded_path(pooling, layout):
    """model.arch=modernbert: rotary from the packed position ids, the local window (16 tokens, under rows of 64)
    composed with each attention group's mask; global layers 0 and 3 of 4."""
    module = _train_module(pooling, arch="modernbert", pooler=False, num_layers=4, local_window=16,
                           layer_norm_eps=1e-5)
    _assert_same(module, _batch(), ("mlm", "nt_xent"), layout)


def test_the_sentence_stage_pair_equals_the_padded_path():
    """The sentence stage's pair (each sentence twice in one pass), SimCSE's InfoNCE, mean pooling."""
    gen = torch.Generator().manual_seed(1)
    ids, mask = _rows([12, 3, 30, 30, 7, 2], 30, gen)
    for layout in LAYOUTS:
        _assert_same(_train_module("mean", stage="sentences"), dict(sentence_ids=ids, sentence_mask=mask),
                     ("info_nce",), layout)


def pairs_batch(seed: int) -> dict:
    """A data.pairs batch: 6 anchors (width 30), positives (24) and hard negatives (16) of very different lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = _rows([12, 3, 30, 30, 7, 2], 30, gen)
    pos, pos_mask = _rows([5, 20, 2, 9, 24, 24], 24, gen)
    neg, neg_mask = _rows([7, 7, 16, 3, 11, 2], 16, gen)
    return dict(sentence_ids=ids, sentence_mask=mask, positive_ids=pos, positive_mask=pos_mask, negative_ids=neg,
                negative_mask=neg_mask)


def test_data_pairs_anchor_and_positive_equal_the_padded_path():
    """data.pairs: anchors and positives of other widths packed into one pass, hard negatives padded (their own pass)."""
    for layout in LAYOUTS:
        _assert_same(_train_module("mean", stage="sentences"), pairs_batch(2), ("info_nce", "info_nce_hard_neg_cos"),
                     layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hidden_states_equal_the_padded_path_at_every_real_token(layout):
    model = build_model(_model_cfg(), seed=0).eval()
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())], layout)
    layers_p = model.encode(batch["input_ids"], batch["attention_mask"], all_layers=True)
    layers_u = model.encode(None, None, packed=packed, all_layers=True)
    for h_BTD, h_ND in zip(layers_p, layers_u, strict=True):
        torch.testing.assert_close(h_ND, h_BTD[batch["attention_mask"]], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(model.pool(layers_u[-1], None, "first_last_avg", all_layers=layers_u, packed=packed),
                               model.pool(layers_p[-1], batch["attention_mask"], "first_last_avg",
                                          all_layers=layers_p), rtol=RTOL, atol=ATOL)
    h_BTD = packed.unpack(layers_u[-1])
    torch.testing.assert_close(h_BTD[batch["attention_mask"]], layers_u[-1])
    assert (h_BTD[~batch["attention_mask"]] == 0).all()


def test_the_comparison_sees_a_leak():
    """Attention not confined to each sequence (all rows in one group, no mask) is caught by the same check."""
    model = build_model(_model_cfg(), seed=0).eval()
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())])
    reference = model.encode(batch["input_ids"], batch["attention_mask"])[batch["attention_mask"]]
    leaky = dataclasses.replace(packed.groups[0], keep_n11t=None)
    packed.groups = (leaky, *packed.groups[1:])
    assert packed.groups[0].num_rows > 1 or len(packed.groups) > 1
    with pytest.raises(AssertionError):
        torch.testing.assert_close(model.encode(None, None, packed=packed), reference, rtol=RTOL, atol=ATOL)


def test_the_comparison_sees_a_leak_in_the_varlen_layout():
    """Two sequences run together (one cumulative length dropped) are caught by the same check (positions for
    the run-together length, which the encoder checks against the longest sequence)."""
    model = build_model(_model_cfg(max_position=128), seed=0).eval()
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())], "varlen")
    reference = model.encode(batch["input_ids"], batch["attention_mask"])[batch["attention_mask"]]
    torch.testing.assert_close(model.encode(None, None, packed=packed), reference, rtol=RTOL, atol=ATOL)
    cu = packed.cu_seqlens_B1
    packed.cu_seqlens_B1 = torch.cat([cu[:1], cu[2:]])
    packed.max_length = int((packed.cu_seqlens_B1[1:] - packed.cu_seqlens_B1[:-1]).max())
    with pytest.raises(AssertionError):
        torch.testing.assert_close(model.encode(None, None, packed=packed), reference, rtol=RTOL, atol=ATOL)


def test_the_varlen_layout_is_offsets_without_groups_and_refused_by_modernbert():
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())], "varlen")
    assert packed.groups == () and packed.gather_P is None and packed.back_N is None
    assert packed.cu_seqlens_B1.tolist() == np.cumsum([0, *LENGTHS]).tolist()
    assert (packed.min_length, packed.max_length) == (min(LENGTHS), max(LENGTHS))
    counts = compute_counts(packed)
    assert counts["unpadded_scores"] == counts["real_scores"] == sum(n * n for n in LENGTHS)
    with pytest.raises(ValueError, match="unknown attention layout"):
        pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())], "flash")
    model = build_model(_model_cfg(arch="modernbert", pooler=False, local_window=16, layer_norm_eps=1e-5), seed=0)
    with pytest.raises(ValueError, match="train.unpadded_attention=groups"):
        model.encode(None, None, packed=packed)


def test_attention_dropout_acts_in_the_packed_path():
    model = build_model(_model_cfg(attention_dropout=0.5), seed=0)
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())])
    h_eval = model.eval().encode(None, None, packed=packed)
    h_train = model.train().encode(None, None, packed=packed)
    assert torch.isfinite(h_train).all() and not torch.allclose(h_train, h_eval)


def test_positions_restart_and_the_host_packs_labels():
    batch = _batch()
    out = host_facts(batch, unpadded=True)
    packed = out["packed_mlm"]
    assert packed.num_tokens == sum(LENGTHS) and packed.first_B.tolist() == np.cumsum([0] + LENGTHS[:-1]).tolist()
    assert packed.position_ids_N[:LENGTHS[0] + 2].tolist() == list(range(64)) + [0, 1]
    labels_N = out["mlm_labels_packed"]
    assert labels_N.tolist() == batch["mlm_labels"][batch["attention_mask"]].tolist()
    assert (labels_N[out["mlm_positions"]] != -100).all() and int((labels_N != -100).sum()) == len(out["mlm_positions"])
    views = out["packed_views"]
    assert views.num_rows == 16 and views.num_tokens == int(batch["view_a_mask"].sum() + batch["view_b_mask"].sum())


def test_pack_refuses_left_padding():
    mask = np.array([[0, 1, 1], [1, 1, 1]], dtype=bool)
    with pytest.raises(ValueError, match="right-padded"):
        pack([(np.zeros((2, 3), dtype=np.int64), mask)])


def test_plan_groups_is_the_cheapest_cut_and_keeps_padding_low():
    rng = np.random.default_rng(0)
    for _ in range(200):  # exhaustive check on small batches
        lengths = rng.integers(1, 12, rng.integers(1, 7))
        for max_groups in (1, 2, 3):
            groups = plan_groups(lengths, max_groups=max_groups, max_waste=0.0)
            assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
            cost = sum(len(g) * lengths[g].max() ** 2 for g in groups)
            ordered = np.sort(lengths)[::-1]
            best = min(sum(len(p) * p.max() ** 2 for p in np.split(ordered, list(cuts)))
                       for k in range(min(max_groups, len(lengths)))
                       for cuts in _combinations(range(1, len(lengths)), k))
            assert cost == best
    lengths = np.where(rng.random(128) < 0.7, 128, rng.integers(2, 129, 128))  # 128 rows, ~30% short
    mask = np.arange(128) < lengths[:, None]
    packed = pack([(np.zeros(mask.shape, dtype=np.int64), mask)])
    counts = compute_counts(packed)
    assert len(packed.groups) <= MAX_GROUPS and counts["real_tokens"] == lengths.sum()
    assert 1 - counts["real_scores"] / counts["padded_scores"] > 0.15  # the padded path: > 15% of scores padding
    assert 1 - counts["real_scores"] / counts["unpadded_scores"] <= 0.02

def test_the_fixed_layout_has_the_same_group_structure_for_every_batch():
    """train.unpadded_attention=fixed (the compiled step's): exactly FIXED_GROUPS groups of two rows or more
    (fewer only under 2 * FIXED_GROUPS rows), longest first, every row once, each with a key mask even where its
    rows are equally long; never more scores than the cheapest cut into at most that many groups, and the cheapest
    cut into exactly that many where few rows leave no group to halve (checked exhaustively)."""
    rng = np.random.default_rng(0)
    for _ in range(1500):
        lengths = rng.integers(2, 12, rng.integers(1, 14))
        if rng.random() < 0.2:
            lengths[:] = lengths[0]  # one length: the groups come from halving alone
        groups = plan_fixed(lengths)
        want = max(1, min(FIXED_GROUPS, len(lengths) // 2))
        assert len(groups) == want and sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
        assert len(lengths) < 2 or min(len(g) for g in groups) >= 2
        assert all(lengths[a].min() >= lengths[b].max() for a, b in zip(groups, groups[1:]))  # longest first
        if len(lengths) < 2:
            continue
        cost = _scores(lengths, groups)
        ordered = np.sort(lengths)[::-1]
        exact = min(sum(len(p) * p.max() ** 2 for p in parts)
                    for cuts in _combinations(range(2, len(lengths) - 1), want - 1)
                    for parts in [np.split(ordered, list(cuts))] if min(map(len, parts)) >= 2)
        assert _scores(lengths, _exact_cut(lengths, want)) == exact
        at_most = plan_groups(lengths, max_groups=want, max_waste=0.0, min_rows=2)
        assert cost <= _scores(lengths, at_most) or cost == exact  # halved, or the exact cut
    lengths = np.full(32, 7)
    lengths[:3] = 9
    mask = np.arange(9) < lengths[:, None]
    packed = pack([(np.zeros(mask.shape, dtype=np.int64), mask)], "fixed")
    assert [(g.num_rows, g.length) for g in packed.groups] == [(3, 9), (14, 7), (7, 7), (8, 7)]
    assert all(g.keep_n11t is not None for g in packed.groups) and packed.longest == 9
    assert [g.keep_n11t is None for g in pack([(np.zeros(mask.shape, dtype=np.int64), mask)]).groups] == [True, True]


def _scores(lengths, groups) -> int:
    return sum(len(g) * lengths[g].max() ** 2 for g in groups)


def _combinations(items, k):
    import itertools

    return itertools.combinations(items, k)


def test_to_device_leaves_a_cpu_step_unpinned_and_whole():
    """train.pin_memory pins only on the way to a CUDA device: on the CPU (where torch without CUDA cannot pin)
    ``to_device(pin=True)`` hands over the host's tensors and packed streams as they are. The CUDA path is
    tests/gpu/test_model_cuda.py::test_a_pinned_batch_arrives_whole_on_the_device."""
    from pretrain.model.packing import Packed
    from pretrain.training.step import to_device

    batch = host_facts(_batch(), unpadded=True)
    moved = to_device(batch, "cpu", pin=True)
    assert moved.keys() == batch.keys()
    for key, value in batch.items():
        if torch.is_tensor(value):
            assert moved[key] is value and not moved[key].is_pinned(), key
        elif isinstance(value, Packed):
            assert torch.equal(moved[key].ids_N, value.ids_N) and not moved[key].ids_N.is_pinned(), key


def test_the_direct_flash_call_fits_atens_schema_and_autograd():
    """``attention.flash_varlen`` (the varlen layout in bf16 on CUDA) runs only on a GPU. On meta tensors aten binds
    its arguments to the op's schema and autograd records the op's own backward, so an argument out of place or of
    the wrong kind fails here, on the CPU; its numbers are tests/gpu/test_model_cuda.py's. q/k/v are strided columns
    of one fused projection, as a flattened layer hands them."""
    from pretrain.model.attention import flash_varlen, flash_varlen_applies

    qkv = torch.randn(10, 3 * 2 * 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (z.view(10, 2, 64) for z in qkv.chunk(3, dim=-1))
    assert not flash_varlen_applies(q, 64)  # not CUDA
    y = flash_varlen(q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32, device="meta"), 6, 0.1)
    assert y.shape == (10, 2, 64) and type(y.grad_fn).__name__ == "FlashAttentionBackward0"
    y.sum().backward()
    assert qkv.grad.shape == qkv.shape
