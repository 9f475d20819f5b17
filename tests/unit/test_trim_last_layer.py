"""train.trim_last_layer: the last layer computes only the tokens a loss reads, with the losses and gradients of
the full last layer, unpadded and padded.

Both arms run the same path in float64, so only the order of summation may differ (a matmul over S rows instead
of N blocks its sums otherwise): the comparison is at 1e-10 of each tensor's largest entry, where a wrong row (a
shifted position, another sequence's token, a missing residual) is off at the percent level
(test_the_comparison_sees_a_wrong_row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_unpadded import pairs_batch

from pretrain.config import ModelConfig, ObjectiveConfig, OpsConfig
from pretrain.config.objective import InfoNCEConfig, MLMConfig, NTXentConfig
from pretrain.distributed.env import single_process_env
from pretrain.model import build_model
from pretrain.model import attention, modern
from pretrain.model.flat import flatten_layers
from pretrain.model.packing import pack
from pretrain.objective import Context, Objective, TrainModule
from pretrain.training.step import host_facts

TOL = 1e-10


def _rows(lengths, width, gen, vocab=50):
    ids = torch.randint(5, vocab, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


def _batch(seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids, mask = _rows([64, 2, 37, 64, 5, 64, 63, 17], 64, gen)
    labels = torch.where(mask & (torch.rand(mask.shape, generator=gen) < 0.15), ids, -100)
    labels[:, 1] = ids[:, 1]
    view_a, mask_a = _rows([32, 3, 20, 32, 9, 31, 2, 32], 32, gen)
    view_b, mask_b = _rows([30, 4, 32, 11, 9, 2, 25, 32], 32, gen)
    return dict(input_ids=ids, attention_mask=mask, mlm_labels=labels, view_a_ids=view_a, view_a_mask=mask_a,
                view_b_ids=view_b, view_b_mask=mask_b)


def _module(trim: bool, *, pooling="cls", mean_mix=0.0, stage="pretrain", flat=False, **model_kw) -> TrainModule:
    base = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
                dropout=0.0, attention_dropout=0.0, pooling=pooling)
    model = build_model(ModelConfig(**{**base, **model_kw}), seed=0).double()
    ctx = Context(env=single_process_env(), ops=OpsConfig(similarity="eager"), pooling=pooling,
                  view_mean_mix=mean_mix, stage=stage, trim_last_layer=trim)
    if stage == "sentences":
        cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(gather=False))
    else:
        cfg = ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False))
    module = TrainModule(model, Objective(cfg, ctx))
    if flat:  # train.flat_params (the trainer's default): the fused q/k/v span, whose q the trimmed layer cuts
        flatten_layers(module.model)
    return module


def _last_layer_rows(module) -> list[int]:
    """Run-time record: how many rows the last layer's FFN computed, per pass."""
    seen: list[int] = []
    layer = module.model.encoder.layers[-1]
    layer.ffn.register_forward_hook(lambda mod, args, out: seen.append(args[0].numel() // args[0].shape[-1]))
    return seen


def _run(module, batch, unpadded=True):
    module.zero_grad(set_to_none=True)
    loss, metrics = module(host_facts(batch, unpadded=unpadded))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v[0].detach() for k, v in metrics.items()}, grads


def assert_same_step(got, want, terms) -> None:
    """Two (loss, metrics, grads) of the same float64 step agree: the terms' metrics and the loss at TOL, every
    gradient at TOL of its tensor's largest entry plus 1e-15 (the key bias's exact gradient is 0)."""
    (loss_g, metrics_g, grads_g), (loss_w, metrics_w, grads_w) = got, want
    for term in terms:
        torch.testing.assert_close(metrics_g[term], metrics_w[term], rtol=TOL, atol=TOL)
    torch.testing.assert_close(loss_g, loss_w, rtol=TOL, atol=TOL)
    assert grads_g.keys() == grads_w.keys() and len(grads_w) > 15
    for name, g in grads_w.items():
        torch.testing.assert_close(grads_g[name], g, rtol=0, atol=TOL * float(g.abs().max()) + 1e-15,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _assert_same(batch, terms, unpadded=True, **kw):
    full, trimmed = _module(False, **kw), _module(True, **kw)
    rows_full, rows_trimmed = _last_layer_rows(full), _last_layer_rows(trimmed)
    assert_same_step(_run(trimmed, batch, unpadded), _run(full, batch, unpadded), terms)
    return rows_full, rows_trimmed


def _counts(batch) -> tuple[int, int, int]:
    """(MLM rows' real tokens, their labelled tokens, the views' real tokens)."""
    views = int(batch["view_a_mask"].sum() + batch["view_b_mask"].sum()) if "view_a_mask" in batch else 0
    return int(batch["attention_mask"].sum()), int((batch["mlm_labels"] != -100).sum()), views


def _count_rows(monkeypatch, owner, name: str) -> list[int]:
    """Run-time record: the kept rows (the last argument's length) of each call of ``owner.name``: ``_QKVOfRows.apply``
    (q on the kept rows only) or ``QueryLayout.of`` (the kept-rows attention)."""
    seen: list[int] = []
    fn = getattr(owner, name)

    def counted(*args):
        seen.append(len(args[-1]))
        return fn(*args)

    monkeypatch.setattr(owner, name, counted)
    return seen


def _count_q_of_rows(monkeypatch) -> list[int]:
    return _count_rows(monkeypatch, attention._QKVOfRows, "apply")


def _count_layouts(monkeypatch) -> list[int]:
    return _count_rows(monkeypatch, attention.QueryLayout, "of")


@pytest.mark.parametrize("norm, pooler, flat", [("post", True, False), ("pre", False, False), ("post", True, True),
                                                ("pre", False, True)])
def test_mlm_and_cls_views_equal_the_full_last_layer(norm, pooler, flat, monkeypatch):
    """The kept rows attend alone (attention.SelfAttention._attend_rows), per-tensor and flat layers; flat ones
    (train.flat_params) project q on the kept rows through the fused span (attention._QKVOfRows)."""
    batch = _batch()
    q_rows, layouts = _count_q_of_rows(monkeypatch), _count_layouts(monkeypatch)
    rows_full, rows_trimmed = _assert_same(batch, ("mlm", "nt_xent"), norm=norm, pooler=pooler, flat=flat)
    kept = [_counts(batch)[1], 2 * batch["view_a_ids"].shape[0]]
    assert layouts == kept and q_rows == (kept if flat else [])
    tokens, labelled, views = _counts(batch)
    assert rows_full == [tokens, views]
    assert rows_trimmed == [labelled, 2 * batch["view_a_ids"].shape[0]]  # the labelled tokens; one [CLS] per view


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_padded_path_is_trimmed_alike(arch):
    """train.unpadded=false (and the compiled step, which runs it): the rows index B*T; padding is computed in every
    layer but the last, which keeps the labelled tokens and each row's [CLS]."""
    batch = _batch(4)
    kw = dict(arch="modernbert", pooler=False, num_layers=3, local_window=16, layer_norm_eps=1e-5) \
        if arch == "modernbert" else {}
    rows_full, rows_trimmed = _assert_same(batch, ("mlm", "nt_xent"), unpadded=False, **kw)
    _, labelled, _ = _counts(batch)
    assert rows_full[0] == batch["input_ids"].numel()
    assert rows_trimmed == [labelled, 2 * batch["view_a_ids"].shape[0]]


def test_modernbert_equals_the_full_last_layer(monkeypatch):
    """model.arch=modernbert, 3 layers, its last a local one (window 16 under rows of 64), and the final norm; its
    fused bias-free q/k/v projects q on the kept rows only."""
    batch = _batch(1)
    q_rows, layouts = _count_q_of_rows(monkeypatch), _count_layouts(monkeypatch)
    rows_full, rows_trimmed = _assert_same(batch, ("mlm", "nt_xent"), arch="modernbert", pooler=False, num_layers=3,
                                           local_window=16, layer_norm_eps=1e-5)
    tokens, labelled, views = _counts(batch)
    assert rows_full == [tokens, views] and rows_trimmed == [labelled, 2 * batch["view_a_ids"].shape[0]]
    assert q_rows == rows_trimmed
    assert layouts == []  # a local last layer attends for every slot (its window follows each query)


@pytest.mark.parametrize("scaled", [True, False])
def test_modernbert_global_last_layer_attends_for_the_kept_queries_only(scaled, monkeypatch):
    """model.arch=modernbert, 4 layers, the last a global one: its kept queries (rotated at their own positions,
    taken from their columns) attend alone (``ModernAttention._attend_rows``), with the full last layer's losses
    and gradients; with RoPE's tables scaled for attention (the CPU's default) and without."""
    batch = _batch(3)
    if not scaled:
        monkeypatch.setattr(modern, "scaled_tables", lambda *a: {})
    q_rows, layouts = _count_q_of_rows(monkeypatch), _count_layouts(monkeypatch)
    _, rows_trimmed = _assert_same(batch, ("mlm", "nt_xent"), arch="modernbert", pooler=False, num_layers=4,
                                   local_window=16, layer_norm_eps=1e-5)
    assert layouts == q_rows == rows_trimmed == [_counts(batch)[1], 2 * batch["view_a_ids"].shape[0]]


@pytest.mark.parametrize("bias", [True, False])
def test_q_on_some_rows_equals_the_full_projection_there(bias):
    """``project_qkv`` with rows: k, v everywhere and q on the rows equal F.linear's (float64), q is zero on the
    other rows, and the gradients of x, the weight and the bias equal the full projection's under an output
    gradient that is zero on q's other rows (what attention gives a row whose output is not read)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(24, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    rows = torch.tensor([0, 3, 4, 17, 39])
    other = torch.ones(40, dtype=torch.bool)
    other[rows] = False
    g = torch.randn(40, 24, dtype=torch.float64, generator=gen)
    g[other, :8] = 0
    got = attention.project_qkv(x, w, b, rows)
    want = F.linear(x, w, b)
    torch.testing.assert_close(got[:, 8:], want[:, 8:], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(got[rows, :8], want[rows, :8], rtol=1e-14, atol=1e-14)
    assert got[other, :8].eq(0).all()
    params = [x, w] + ([b] if bias else [])
    grads_got = torch.autograd.grad(got, params, g)
    grads_want = torch.autograd.grad(want, params, g)
    for got_p, want_p in zip(grads_got, grads_want):
        torch.testing.assert_close(got_p, want_p, rtol=1e-13, atol=1e-13)
    # More than half the rows kept: the full projection (q of every row)
    many = torch.arange(21)
    assert attention.project_qkv(x, w, b, many)[30:, :8].ne(0).all()


@pytest.mark.parametrize("pooling, mean_mix", [("mean", 0.0), ("cls", 0.5)])
def test_a_pair_read_at_every_token_keeps_its_full_last_layer(pooling, mean_mix):
    """Mean pooling (or mean blended into [CLS] early in CLEAR) reads every token: only the MLM pass is trimmed."""
    batch = _batch(2)
    rows_full, rows_trimmed = _assert_same(batch, ("mlm", "nt_xent"), pooling=pooling, mean_mix=mean_mix)
    tokens, labelled, views = _counts(batch)
    assert rows_trimmed == [labelled, views]


def test_the_sentence_stage_pair_is_trimmed_to_its_cls():
    gen = torch.Generator().manual_seed(3)
    ids, mask = _rows([12, 3, 30, 30, 7, 2], 30, gen)
    _, rows_trimmed = _assert_same(dict(sentence_ids=ids, sentence_mask=mask), ("info_nce",), stage="sentences")
    assert rows_trimmed == [2 * ids.shape[0]]


def test_data_pairs_hard_negatives_are_trimmed_to_their_cls():
    """data.pairs: anchors and positives in one unpadded pass, hard negatives in a padded pass of their own."""
    batch = pairs_batch(5)
    _, rows_trimmed = _assert_same(batch, ("info_nce", "info_nce_hard_neg_cos"), stage="sentences")
    assert rows_trimmed == [2 * batch["sentence_ids"].shape[0], batch["negative_ids"].shape[0]]


def test_the_comparison_sees_a_wrong_row():
    """The check above fails when the last layer's rows are not the tokens the losses read (each one moved to the
    next stream position), so it can tell."""
    model = build_model(ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64,
                                    max_position=64, dropout=0.0, attention_dropout=0.0), seed=0).double().eval()
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())])
    full_ND = model.encode(None, None, packed=packed)
    rows_S = torch.tensor([0, 5, 70, 71, 200])
    torch.testing.assert_close(model.encode(None, None, packed=packed, rows_S=rows_S), full_ND[rows_S], rtol=TOL,
                               atol=TOL)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(model.encode(None, None, packed=packed, rows_S=rows_S + 1), full_ND[rows_S],
                                   rtol=TOL, atol=TOL)


def test_rows_give_one_output_layer():
    model = build_model(ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64,
                                    max_position=64), seed=0)
    batch = _batch()
    packed = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())])
    for kw in (dict(packed=packed), {}):
        with pytest.raises(ValueError, match="cannot go with all_layers"):
            model.encode(batch["input_ids"], batch["attention_mask"], rows_S=torch.tensor([0]), all_layers=True,
                         **kw)


def test_dropout_in_the_trimmed_layer_trains():
    """With dropout the trimmed step runs, is finite and reaches every parameter the full step reaches."""
    full, trimmed = (_module(t, dropout=0.1, attention_dropout=0.1) for t in (False, True))
    full.train(), trimmed.train()
    _, _, grads_f = _run(full, _batch())
    loss, _, grads_t = _run(trimmed, _batch())
    assert torch.isfinite(loss) and grads_t.keys() == grads_f.keys()
    assert all(torch.isfinite(g).all() for g in grads_t.values())


def test_the_query_layout_of_some_slots():
    """Groups (n, t) = (2, 4), (3, 2), (1, 3): slots 0-7, 8-13, 14-16; queries at slots 13, 1, 3, 8, 2, 12: group 0
    has 3 in its row 0 (m = 3), group 1 one in row 0 and two in row 2 (m = 2), group 2 none (left out)."""
    from types import SimpleNamespace

    layout = attention.QueryLayout.of(SimpleNamespace(group_shapes=((2, 4), (3, 2), (1, 3))),
                                      torch.tensor([13, 1, 3, 8, 2, 12]))
    assert layout.groups == ((0, 2, 3), (1, 3, 2))
    assert layout.sub_S.tolist() == [11, 0, 2, 6, 1, 10]
    assert layout.num_slots == 12 and layout.group_shapes == ((2, 3), (3, 2))
    # each query's column in its row (slot 13: group 1's row 2, column 1); empty query slots read column 0
    assert [c.tolist() for c in layout.columns()] == [[[1, 2, 3], [0, 0, 0]], [[0, 0], [0, 0], [0, 1]]]


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_dropout_in_the_kept_rows_attention_trains(arch, monkeypatch):
    """Flat layers with dropout (BERT; ModernBERT with a global last layer): the kept rows' attention (q of the
    kept slots only) runs, the step is finite and reaches every parameter the full step reaches."""
    seen = _count_layouts(monkeypatch)
    kw = dict(arch="modernbert", pooler=False, num_layers=4, local_window=16, layer_norm_eps=1e-5) \
        if arch == "modernbert" else {}
    full, trimmed = (_module(t, dropout=0.1, attention_dropout=0.1, flat=True, **kw) for t in (False, True))
    full.train(), trimmed.train()
    _, _, grads_f = _run(full, _batch())
    loss, _, grads_t = _run(trimmed, _batch())
    assert seen == [_counts(_batch())[1], 2 * _batch()["view_a_ids"].shape[0]]
    assert torch.isfinite(loss) and grads_t.keys() == grads_f.keys()
    assert all(torch.isfinite(g).all() for g in grads_t.values())
