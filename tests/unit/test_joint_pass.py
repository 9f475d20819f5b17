"""train.joint_pass: the MLM rows and CLEAR's views through one encoder pass, against the two passes they replace:
unpadded, over the host's joint stream; padded (the compiled step's path), over the two padded batches end to end
(``packing.padded_stream``).

Both arms run in float64 with dropout off, so only the order of summation may differ (matrix products over the
joint stream's rows instead of each pass's): losses and metrics are compared at 1e-10, gradients at 1e-10 of each
tensor's largest entry plus 1e-15 absolute (the key bias's gradient is 0 in exact arithmetic, ~1e-19 of rounding
noise in either arm). A sequence attending across the MLM rows / views boundary, a view read from the MLM rows'
part of the stream, or a trimmed row taken from the wrong offset is off at the percent level
(test_the_comparison_sees_a_shifted_split).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from test_trim_last_layer import _batch, assert_same_step

from pretrain.config import ModelConfig, ObjectiveConfig, OpsConfig
from pretrain.config.objective import (
    InfoNCEConfig,
    MatryoshkaConfig,
    MLMConfig,
    NTXentConfig,
    ReconstructionConfig,
)
from pretrain.distributed.env import single_process_env
from pretrain.model import build_model
from pretrain.model.packing import pack, padded_stream
from pretrain.objective import Context, Objective, TrainModule
from pretrain.objective import forward as forward_module
from pretrain.objective.forward import Forward
from pretrain.training.step import host_facts

TOL = 1e-10


def _module(*, trim: bool = True, pooling: str = "cls", mean_mix: float = 0.0, objective: ObjectiveConfig | None = None,
            stage: str = "pretrain", joint: bool = True, token_freq_V=None, **model_kw) -> TrainModule:
    base = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
                dropout=0.0, attention_dropout=0.0, pooling=pooling)
    model = build_model(ModelConfig(**{**base, **model_kw}), seed=0).double()
    ctx = Context(env=single_process_env(), ops=OpsConfig(similarity="eager"), pooling=pooling,
                  view_mean_mix=mean_mix, stage=stage, trim_last_layer=trim, joint_pass=joint)
    objective = objective or ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False))
    return TrainModule(model, Objective(objective, ctx, token_freq_V=token_freq_V)).double()  # heads too


@contextlib.contextmanager
def _joint_pass(module, on: bool):
    """The objective's joint pass turned off for a while (``on=False``), where it had kept it."""
    ctx = module.objective.ctx
    module.objective.ctx = dataclasses.replace(ctx, joint_pass=ctx.joint_pass and on)
    try:
        yield
    finally:
        module.objective.ctx = ctx


def _run(module, batch, joint: bool, unpadded: bool = True):
    """(loss, metrics, grads, encoder passes, rows of the last layer's FFN per pass) of one step's forward and
    backward, with the host's joint stream in the batch or not; ``unpadded=False``: the padded step, its joint
    pass on or off as ``joint`` says (where the objective keeps it)."""
    passes, rows = [], []
    hooks = [module.model.encoder.layers[0].register_forward_hook(lambda *a: passes.append(1)),
             module.model.encoder.layers[-1].ffn.register_forward_hook(
                 lambda mod, args, out: rows.append(args[0].numel() // args[0].shape[-1]))]
    module.zero_grad(set_to_none=True)
    with _joint_pass(module, joint or unpadded):
        loss, metrics = module(host_facts(batch, unpadded=unpadded, joint=joint))
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v[0].detach() for k, v in metrics.items()}, grads, len(passes), rows


def _assert_same(module, batch, terms=("mlm", "nt_xent"), unpadded: bool = True) -> tuple[list[int], list[int]]:
    """The joint pass equals the two passes; -> the last layer's FFN rows of (two passes, joint pass)."""
    *two, passes_s, rows_s = _run(module, batch, joint=False, unpadded=unpadded)
    *joint, passes_j, rows_j = _run(module, batch, joint=True, unpadded=unpadded)
    assert (passes_s, passes_j) == (2, 1)
    assert_same_step(joint, two, terms)
    return rows_s, rows_j


@pytest.mark.parametrize("norm, pooler", [("post", True), ("pre", False)])
@pytest.mark.parametrize("trim", [True, False])
def test_cls_views_and_mlm_equal_two_passes(norm, pooler, trim):
    batch = _batch()
    rows_s, rows_j = _assert_same(_module(trim=trim, norm=norm, pooler=pooler), batch)
    assert rows_j == [sum(rows_s)]  # the union of what the two passes' last layers computed
    if trim:  # the labelled tokens, then one [CLS] per view
        assert rows_s == [int((batch["mlm_labels"] != -100).sum()), 2 * batch["view_a_ids"].shape[0]]


@pytest.mark.parametrize("mean_mix", [0.0, 0.5])
def test_mean_pooled_views_keep_every_token_of_the_last_layer(mean_mix):
    """Mean pooling (or CLEAR's early blend of it into [CLS]): the views' part of the trimmed last layer is every
    view token, the MLM rows' part their labelled tokens."""
    batch = _batch(2)
    pooling = "mean" if mean_mix == 0.0 else "cls"
    rows_s, rows_j = _assert_same(_module(pooling=pooling, mean_mix=mean_mix), batch)
    views = int(batch["view_a_mask"].sum() + batch["view_b_mask"].sum())
    assert rows_s == [int((batch["mlm_labels"] != -100).sum()), views] and rows_j == [sum(rows_s)]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_equals_two_passes(pooling):
    """Rotary positions restart per sequence in the joint stream; the local window (16 under rows of 64) and the
    global layers (0 and 3 of 4) keep every sequence to itself."""
    module = _module(pooling=pooling, arch="modernbert", pooler=False, num_layers=4, local_window=16,
                     layer_norm_eps=1e-5)
    _assert_same(module, _batch(1))


@pytest.mark.parametrize("unpadded", [True, False])
def test_sarcse_reconstruction_reads_the_views_part_unpacked(unpadded):
    """SARCSE's autoencoder beside MLM in pretraining: it reads every view token in rows (``pair_hidden`` unpacks the
    views' part of the joint pass with the views' own stream, or views it back as the padded batch); the last layer
    is not trimmed for the views."""
    objective = ObjectiveConfig(mlm=MLMConfig(), nt_xent=None, info_nce=InfoNCEConfig(gather=False),
                                reconstruction=ReconstructionConfig(channels=6, integrate_channels=2))
    module = _module(objective=objective, token_freq_V=torch.linspace(1.0, 2.0, 50, dtype=torch.float64))
    _assert_same(module, _batch(3), ("mlm", "info_nce", "reconstruction"), unpadded=unpadded)


@pytest.mark.parametrize("unpadded", [True, False])
def test_matryoshka_nested_view_embeddings_equal_two_passes(unpadded):
    objective = ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False),
                                matryoshka=MatryoshkaConfig(dims=[32, 8]))
    _assert_same(_module(objective=objective), _batch(5), unpadded=unpadded)


def test_the_joint_stream_is_the_two_streams_end_to_end():
    """What ``_joint_pass`` splits by: the MLM rows' stream, then the views', positions restarting per sequence;
    attention groups over all of them (each row in exactly one)."""
    out = host_facts(_batch(), unpadded=True, joint=True)
    joint, mlm, views = out["packed_joint"], out["packed_mlm"], out["packed_views"]
    assert torch.equal(joint.ids_N, torch.cat([mlm.ids_N, views.ids_N]))
    assert torch.equal(joint.position_ids_N, torch.cat([mlm.position_ids_N, views.position_ids_N]))
    assert torch.equal(joint.lengths_B, torch.cat([mlm.lengths_B, views.lengths_B]))
    assert sum(g.num_rows for g in joint.groups) == mlm.num_rows + views.num_rows
    b = _batch()  # joined from the two streams' tokens: what packing all their padded rows at once gives
    whole = pack([(b["input_ids"].numpy(), b["attention_mask"].numpy()),
                  *((b[f"view_{v}_ids"].numpy(), b[f"view_{v}_mask"].numpy()) for v in "ab")])
    for field in ("ids_N", "position_ids_N", "row_N", "first_B", "lengths_B", "index_N", "back_N", "gather_P"):
        assert torch.equal(getattr(joint, field), getattr(whole, field)), field
    assert [(g.num_rows, g.length) for g in joint.groups] == [(g.num_rows, g.length) for g in whole.groups]
    assert all(torch.equal(a.keep_n11t, w.keep_n11t) if w.keep_n11t is not None else a.keep_n11t is None
               for a, w in zip(joint.groups, whole.groups))
    assert joint.width == whole.width == 64
    assert "packed_joint" not in host_facts(_batch(), unpadded=True)  # only when asked (train.joint_pass)


@pytest.mark.parametrize("unpadded", [True, False])
def test_the_comparison_sees_a_shifted_split(unpadded):
    """The same check fails when the views' part is read one token off (a wrong offset into the joint stream)."""
    module = _module(trim=False, pooling="mean")
    batch = _batch()
    reference = _run(module, batch, joint=False, unpadded=unpadded)[0]
    original = Forward._joint_pass

    def shifted(self):
        original(self)
        h, *rest = self._cache["pair_h"]
        self._cache["pair_h"] = (torch.roll(h, 1, 0), *rest)

    Forward._joint_pass = shifted
    try:
        loss = _run(module, batch, joint=True, unpadded=unpadded)[0]
    finally:
        Forward._joint_pass = original
    with pytest.raises(AssertionError):
        torch.testing.assert_close(loss, reference, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("objective, stage", [
    (ObjectiveConfig(mlm=MLMConfig(), nt_xent=None), "pretrain"),  # no views to share the pass with
    (ObjectiveConfig(mlm=None, nt_xent=NTXentConfig(gather=False)), "pretrain"),  # no MLM rows
    (ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(gather=False)), "sentences"),
    (ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False), gradient_cache=True), "pretrain"),
])
def test_the_objective_keeps_the_joint_pass_only_where_one_pass_serves_both(objective, stage):
    assert not _module(objective=objective, stage=stage).objective.ctx.joint_pass
    assert _module().objective.ctx.joint_pass
    assert not _module(joint=False).objective.ctx.joint_pass


def test_beside_the_joint_stream_the_two_streams_carry_no_attention_layout():
    """With the joint stream the encoder never runs over the MLM rows' or views' own streams, so the host skips
    their attention groups (most of the packing's time); run over anyway, one says what is wrong."""
    facts = host_facts(_batch(), unpadded=True, joint=True)
    assert facts["packed_mlm"].groups == () and facts["packed_views"].groups == ()
    assert facts["packed_mlm"].gather_P.numel() == 0 and len(facts["packed_joint"].groups) >= 2
    separate = host_facts(_batch(), unpadded=True)
    assert separate["packed_mlm"].groups and separate["packed_views"].groups
    assert torch.equal(facts["packed_views"].first_B, separate["packed_views"].first_B)
    module = _module(joint=False)  # a two-pass objective handed the joint step's batch
    with pytest.raises(ValueError, match="packed without its attention layout"):
        module(facts)


def test_a_mlm_only_objective_runs_one_pass_of_its_rows():
    """train.joint_pass on, an MLM-only objective: the step asks the host for no joint stream (it packs as the
    objective decided, ``Context.joint_pass``) and the MLM rows run their own pass."""
    module = _module(objective=ObjectiveConfig(mlm=MLMConfig(), nt_xent=None))
    loss, _, _, passes, rows = _run(module, _batch(), joint=module.objective.ctx.joint_pass)
    assert passes == 1 and rows == [int((_batch()["mlm_labels"] != -100).sum())] and torch.isfinite(loss)


PADDED_MODELS = {
    "post-LN, pooler": dict(norm="post", pooler=True),
    "pre-LN": dict(norm="pre", pooler=False),
    "RoBERTa positions": dict(position_offset=2, max_position=66),
    "modernbert": dict(arch="modernbert", pooler=False, num_layers=4, local_window=16, layer_norm_eps=1e-5),
}


@pytest.mark.parametrize("model", list(PADDED_MODELS))
@pytest.mark.parametrize("pooling, trim", [("cls", True), ("cls", False), ("mean", True)])
def test_padded_joint_pass_equals_two_padded_passes(model, pooling, trim):
    """The padded step (train.unpadded=false, and the compiled step's path): one pass over both padded batches end
    to end, each attended to at its own width, equals the two padded passes; trimmed, the last layer computes
    the union of their rows (flat indices into the MLM batch, then each view's [CLS] past it)."""
    batch = _batch(1)
    rows_s, rows_j = _assert_same(_module(trim=trim, pooling=pooling, **PADDED_MODELS[model]), batch, unpadded=False)
    assert rows_j == [sum(rows_s)]
    if trim and pooling == "cls":
        assert rows_s == [int((batch["mlm_labels"] != -100).sum()), 2 * batch["view_a_ids"].shape[0]]


def test_padded_joint_pass_without_padding_passes_no_mask(monkeypatch):
    """Rows the host knows to be full attend with no mask (SDPA may take its flash kernel), as the padded pass."""
    batch = _batch(1)
    for key in ("attention_mask", "view_a_mask", "view_b_mask"):
        batch[key] = torch.ones_like(batch[key])
    _assert_same(_module(), batch, unpadded=False)
    streams = []
    monkeypatch.setattr(forward_module, "padded_stream", lambda blocks: streams.append(padded_stream(blocks))
                        or streams[-1])
    _run(_module(), batch, joint=True, unpadded=False)
    assert [g.keep_n11t for g in streams[0].groups] == [None, None]


def test_the_padded_stream_is_the_padded_batches_end_to_end():
    """Its tokens are the batches' rows, pads included; positions restart at each row; one attention group per
    batch at its width with its key mask; no gather (the stream is its slots)."""
    b = _batch()
    keep = b["attention_mask"].bool()[:, None, None, :]
    views = torch.cat([b["view_a_ids"], b["view_b_ids"]])
    s = padded_stream([(b["input_ids"], keep), (views, None)])
    (n, t), (nv, tv) = b["input_ids"].shape, views.shape
    assert torch.equal(s.ids_N, torch.cat([b["input_ids"].flatten(), views.flatten()]))
    assert torch.equal(s.position_ids_N, torch.cat([torch.arange(t).repeat(n), torch.arange(tv).repeat(nv)]))
    assert [(g.num_rows, g.length) for g in s.groups] == [(n, t), (nv, tv)]
    assert s.groups[0].keep_n11t is keep and s.groups[1].keep_n11t is None
    assert s.gather_P is None and s.slots() is None and s.num_rows == n + nv and s.width == max(t, tv)
    rows = torch.tensor([3, 0])
    assert s.slots(rows) is rows


def test_a_batch_without_the_hosts_facts_takes_the_padded_joint_pass():
    """Validation's batches come without the host's facts (no MLM positions, no record of full masks): the padded
    joint pass then trims the views' last layer to their [CLS] but not the MLM rows', and looks at the masks on the
    device, as the two padded passes do."""
    module = _module()
    results = []
    for joint in (False, True):
        with _joint_pass(module, joint), torch.no_grad():
            loss, metrics = module(_batch(2))
        results.append((loss, {k: v[0] for k, v in metrics.items()}))
    (loss_two, metrics_two), (loss_one, metrics_one) = results
    torch.testing.assert_close(loss_one, loss_two, rtol=TOL, atol=TOL)
    assert metrics_one.keys() == metrics_two.keys()
    for key, value in metrics_two.items():
        torch.testing.assert_close(torch.as_tensor(metrics_one[key], dtype=torch.float64),
                                   torch.as_tensor(value, dtype=torch.float64), rtol=TOL, atol=TOL)
