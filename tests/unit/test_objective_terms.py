"""Seed-objective terms through the composer (pretrain.objective) on a tiny model.

Each term's normalised loss must equal a float64 reference written here from the embeddings
(not via pretrain.losses); gradients must reach the model and the SARCSE autoencoder but
never the RankCSE teachers; the triplet branch must run with dropout off.
Legend: B sentences, T tokens, P embedding dim, Bt triplets.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain.config.model import ModelConfig
from pretrain.config.objective import (
    ArcConConfig,
    ConsistencyConfig,
    InfoNCEConfig,
    ObjectiveConfig,
    RankDistillConfig,
    ReconstructionConfig,
    TripletConfig,
)
from pretrain.config.train import OpsConfig
from pretrain.model import build_model
from pretrain.objective import Context, Forward, Objective, Teachers, TrainModule
from pretrain.objective.terms import _truncate, triplet_term

VOCAB, CLS, SEP, MASK = 40, 2, 3, 4
ENV = SimpleNamespace(rank=0, world_size=1, is_distributed=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int, dropout: float = 0.0):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_position=64,
                      dropout=dropout, attention_dropout=dropout, pooling="mean", projection_layers=2,
                      projection_activation="tanh")
    return build_model(cfg, seed=seed).double()


def _batch(num: int = 6, seed: int = 0, with_triplet: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 12, size=num)
    t = int(lengths.max()) + 2
    ids = torch.zeros(num, t, dtype=torch.long)
    mask = torch.zeros(num, t, dtype=torch.bool)
    for b, n in enumerate(lengths):
        ids[b, : n + 2] = torch.tensor([CLS, *rng.integers(6, VOCAB, size=n), SEP])
        mask[b, : n + 2] = True
    batch = {"sentence_ids": ids, "sentence_mask": mask, "input_ids": ids, "attention_mask": mask}
    if with_triplet:
        rows = [0, 2, 3]
        anchor, amask = ids[rows], mask[rows]
        low, high = anchor.clone(), anchor.clone()
        low[:, 1:3] = MASK
        high[:, 1:5] = MASK
        batch.update(triplet_index=torch.tensor(rows), triplet_anchor_ids=anchor, triplet_anchor_mask=amask,
                     triplet_low_ids=low * amask, triplet_low_mask=amask, triplet_high_ids=high * amask,
                     triplet_high_mask=amask)
    return batch


def _objective(ctx_pooling="mean", **terms) -> tuple[Objective, Context]:
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, **terms)
    ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling=ctx_pooling, stage="sentences")
    return cfg, ctx


def _embed(model, ids, mask):
    return model.projection(model.pool(model.encode(ids, mask), mask, "mean"))


def _pooled(model, ids, mask):
    return model.pool(model.encode(ids, mask), mask, "mean")


def _ref_info_nce(q, k, tau, margin=0.0):
    """mean_i -log softmax_j(l_ij)[i], l_ii = cos(acos(c_ii) + m) / tau, float64 loops."""
    q, k = F.normalize(q.double(), dim=-1), F.normalize(k.double(), dim=-1)
    total = 0.0
    for i in range(q.shape[0]):
        logits = [float(q[i] @ k[j]) / tau for j in range(k.shape[0])]
        c = float(q[i] @ k[i])
        logits[i] = math.cos(math.acos(max(-1.0, min(1.0, c))) + margin) / tau
        mx = max(logits)
        total += -(logits[i] - mx - math.log(sum(math.exp(x - mx) for x in logits)))
    return total / q.shape[0]


@pytest.mark.parametrize("term", ["info_nce", "arccon"])
def test_pair_terms_match_reference(term):
    model = _model(1)
    batch = _batch()
    cfg = {"info_nce": InfoNCEConfig(temperature=0.05)} if term == "info_nce" else \
        {"arccon": ArcConConfig(temperature=0.05, margin_deg=10.0)}
    ocfg, ctx = _objective(**cfg)
    loss, metrics = Objective(ocfg, ctx)(model, batch)
    with torch.no_grad():  # dropout 0: both passes give the same z; the positive is still cos = 1
        z = _embed(model, batch["sentence_ids"], batch["sentence_mask"])
    margin = math.radians(10.0) if term == "arccon" else 0.0
    ref = _ref_info_nce(z, z, 0.05, margin)
    # ArcCon at theta = 0 (identical views): the margin op's safe branch is exact to ~1e-8 there.
    assert loss.item() == pytest.approx(ref, rel=1e-9 if term == "info_nce" else 1e-7)
    assert metrics[term][1] == batch["sentence_ids"].shape[0]


def test_dropout_views_differ_and_doubled_batch_is_one_pass():
    model = _model(1, dropout=0.3)
    calls = []
    model.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    ocfg, ctx = _objective(info_nce=InfoNCEConfig())
    obj = Objective(ocfg, ctx)
    torch.manual_seed(0)
    from pretrain.objective import Forward

    fwd = Forward(model.train(), _batch(), ctx)
    z1, z2 = fwd.pair()
    assert calls == [2 * z1.shape[0]]
    assert not torch.allclose(z1, z2)
    obj(model, _batch())  # runs


def _ref_js(a, b, tau):
    p, q = F.softmax(a / tau, -1), F.softmax(b / tau, -1)
    m = (p + q) / 2
    return float((0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)).mean())


def _cos_mat(a, b):
    return F.normalize(a.double(), dim=-1) @ F.normalize(b.double(), dim=-1).T


def test_rankcse_terms_match_reference_and_teachers_stay_frozen():
    student, t1, t2 = _model(1), _model(2), _model(3)
    batch = _batch(7)
    rd = RankDistillConfig(method="listnet", teachers=["a", "b"], teacher_weights=[0.25, 0.75],
                           teacher_pooling="mean", student_temperature=0.05, teacher_temperature=0.025)
    ocfg, ctx = _objective(info_nce=InfoNCEConfig(weight=1.0), consistency=ConsistencyConfig(weight=0.5),
                           rank_distill=rd)
    teachers = Teachers(rd, models=[t1, t2])
    module = TrainModule(student, Objective(ocfg, ctx, teachers=teachers))
    loss, metrics = module(batch)
    ids, mask = batch["sentence_ids"], batch["sentence_mask"]
    with torch.no_grad():
        z = _embed(student, ids, mask)
        s = _cos_mat(z, z)
        e1, e2 = _pooled(t1, ids, mask), _pooled(t2, ids, mask)  # teachers: pooled, no projection
        st = 0.25 * _cos_mat(e1, e1) + 0.75 * _cos_mat(e2, e2)
        st = torch.stack([torch.cat([r[:i], r[i + 1:]]) for i, r in enumerate(st)])
        ss = torch.stack([torch.cat([r[:i], r[i + 1:]]) for i, r in enumerate(s)])
    listnet_ref = float(-(F.softmax(st / 0.025, -1) * F.log_softmax(ss / 0.05, -1)).sum(-1).mean())
    ref = _ref_info_nce(z, z, 0.05) + 0.5 * _ref_js(s, s, 0.05) + 1.0 * listnet_ref
    assert loss.item() == pytest.approx(ref, rel=1e-9)
    assert metrics["rank_distill"][0] / metrics["rank_distill"][1] == pytest.approx(listnet_ref, rel=1e-9)
    loss.backward()
    assert all(p.grad is None for t in (t1, t2) for p in t.parameters())
    assert not any(p is q for p in module.parameters() for t in (t1, t2) for q in t.parameters())
    for name, p in module.named_parameters():
        if name.startswith(("model.encoder.", "model.projection.")):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_listmle_term_matches_plackett_luce():
    student, teacher = _model(1), _model(5)
    batch = _batch(5)
    rd = RankDistillConfig(method="listmle", teachers=["t"], teacher_pooling="mean", student_temperature=0.1)
    ocfg, ctx = _objective(info_nce=InfoNCEConfig(weight=0.0), rank_distill=rd)
    loss, _ = Objective(ocfg, ctx, teachers=Teachers(rd, models=[teacher]))(student, batch)
    ids, mask = batch["sentence_ids"], batch["sentence_mask"]
    with torch.no_grad():
        s = _cos_mat(*(2 * [_embed(student, ids, mask)]))
        t = _cos_mat(*(2 * [_pooled(teacher, ids, mask)]))
    total = 0.0
    for i in range(s.shape[0]):
        cols = [j for j in range(s.shape[1]) if j != i]
        order = sorted(cols, key=lambda j: -float(t[i, j]))
        sc = [float(s[i, j]) / 0.1 for j in order]
        total += sum(math.log(sum(math.exp(x) for x in sc[k:])) - sc[k] for k in range(len(sc)))
    assert loss.item() == pytest.approx(total / s.shape[0], rel=1e-9)


def test_triplet_term_matches_reference_with_dropout_off():
    model = _model(1, dropout=0.5).train()
    batch = _batch(with_triplet=True)
    ocfg, ctx = _objective(arccon=ArcConConfig(weight=0.0), triplet=TripletConfig(weight=1.0))
    obj = Objective(ocfg, ctx)
    torch.manual_seed(0)
    loss_a, m_a = obj(model, batch)
    torch.manual_seed(1)
    loss_b, m_b = obj(model, batch)
    assert model.training and all(m.training for m in model.modules())  # flags restored
    assert m_a["arccon"][0] != m_b["arccon"][0]  # the ArcCon views do see dropout ...
    assert loss_a.item() == loss_b.item()  # ... the triplet branch does not
    with torch.no_grad():
        model.eval()
        e = [_embed(model, batch[f"triplet_{k}_ids"], batch[f"triplet_{k}_mask"]) for k in ("anchor", "low", "high")]
        model.train()
    ref = np.mean([max(0.0, float(F.cosine_similarity(e[0][i], e[2][i], 0) - F.cosine_similarity(e[0][i], e[1][i], 0)))
                   for i in range(3)])
    assert loss_a.item() == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert m_a["triplet"][1] == 3


def test_triplet_needs_sentence_stage_and_handles_empty_batches():
    model = _model(1)
    ocfg, ctx = _objective(arccon=ArcConConfig(), triplet=TripletConfig())
    batch = _batch()
    with pytest.raises(ValueError, match="data.stage=sentences"):
        Objective(ocfg, ctx)(model, batch)
    batch.update(triplet_index=torch.zeros(0, dtype=torch.long),
                 **{f"triplet_{k}_{s}": torch.zeros(0, 0, dtype=torch.long) for k in ("anchor", "low", "high")
                    for s in ("ids", "mask")})
    loss, metrics = Objective(ocfg, ctx)(model, batch)
    assert metrics["triplet"][1] == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("layers,pooler", [(2, False), (0, True), (0, False)])
def test_an_empty_triplet_chunks_zero_reaches_the_sentence_heads_parameters(layers, pooler):
    """A chunk with no triplet rows gives 0 through the projection head's own call (every one of its parameters a
    zero gradient); with no projection layers (the SimCSE-style recipes: the pooler is the MLP) through the
    pooler's; with neither, a plain zero. Its value is 0 either way."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_position=64,
                      pooling="cls", pooler=pooler, projection_layers=layers)
    model = build_model(cfg, seed=0).double()
    assert (len(list(model.projection.parameters())) == 0) == (layers == 0)
    batch = _batch()
    batch.update(triplet_index=torch.zeros(0, dtype=torch.long),
                 **{f"triplet_{k}_{s}": torch.zeros(0, 0, dtype=torch.long) for k in ("anchor", "low", "high")
                    for s in ("ids", "mask")})
    ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling="cls", stage="sentences")
    zero, count, _ = triplet_term(Forward(model, batch, ctx), TripletConfig(), ctx)
    assert count == 0 and float(zero) == 0.0
    head = model.projection if layers else model.pooler
    if head is None:
        assert not zero.requires_grad
        return
    zero.backward()
    grads = [p.grad for p in head.parameters()]
    assert grads and all(g is not None and not g.any() for g in grads)


def test_reconstruction_term_matches_reference_and_trains_the_autoencoder():
    model = _model(1)
    batch = _batch(5)
    freq = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    freq = freq / freq.sum()
    rc = ReconstructionConfig(weight=0.3, positive_weight=0.7, theta=0.1, lam=5.0, channels=6, integrate_channels=2)
    ocfg, ctx = _objective(info_nce=InfoNCEConfig(), reconstruction=rc)
    obj = Objective(ocfg, ctx, token_freq_V=freq)
    module = TrainModule(model, obj).double()
    loss, metrics = module(batch)
    ids, mask = batch["sentence_ids"], batch["sentence_mask"]
    ae = module.heads["autoencoder"]
    with torch.no_grad():
        h = model.encode(ids, mask)
        lengths = mask.sum(1)
        x, cmask = h[:, 1:-1], mask[:, 1:-1].clone()
        for b, n in enumerate(lengths):
            cmask[b, n - 2:] = False
        z, recon = ae(x, cmask)
        lr = 0.0
        for b in range(ids.shape[0]):
            n = int(lengths[b]) - 2
            w = torch.clamp(1 - 5.0 * freq[ids[b, 1:1 + n]], min=0.1)
            lr += float((w * ((recon[b, :n] - x[b, :n]) ** 2).mean(-1)).sum() / n)
        lr /= ids.shape[0]
    ref = _ref_info_nce(z, z, 0.05) + 0.3 * lr + 0.7 * lr  # dropout 0: L_R+ == L_R
    assert loss.item() == pytest.approx(ref, rel=1e-9)
    loss.backward()
    for name, p in module.named_parameters():
        if name.startswith(("model.encoder.", "heads.")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert any(k.startswith("heads.autoencoder.") for k in module.state_dict())


def test_mlm_composes_with_info_nce():
    model = _model(1)
    batch = _batch()
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, 1] = batch["input_ids"][:, 1]
    masked = batch["input_ids"].clone()
    masked[:, 1] = MASK
    batch.update(input_ids=masked, mlm_labels=labels)
    cfg = ObjectiveConfig(nt_xent=None, info_nce=InfoNCEConfig(weight=2.0))
    ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling="mean", stage="sentences")
    loss, metrics = Objective(cfg, ctx)(model, batch)
    with torch.no_grad():
        z = _embed(model, batch["sentence_ids"], batch["sentence_mask"])
        logits = model.mlm_head(model.encode(masked, batch["attention_mask"])[:, 1])
        mlm = float(F.cross_entropy(logits, labels[:, 1]))
    assert loss.item() == pytest.approx(mlm + 2.0 * _ref_info_nce(z, z, 0.05), rel=1e-6)  # mlm_loss runs in fp32


def test_truncate_keeps_sep():
    ids = torch.tensor([[2, 7, 8, 9, 3], [2, 7, 3, 0, 0]])
    mask = ids != 0
    out, m = _truncate(ids, mask, 4)
    assert out.tolist() == [[2, 7, 8, 3], [2, 7, 3, 0]] and m.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


# ---------------------------------------------------------------- two gloo ranks: gathered pair terms


class _Toy(torch.nn.Module):
    """Stand-in model: embedding -> masked mean -> linear projection (deterministic, no dropout)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8).double()
        self.projection = torch.nn.Linear(8, 8).double()

    def encode(self, ids, mask):
        return self.emb(ids)

    def pool(self, h, mask, pooling):
        m = mask.double()[..., None]
        return (h * m).sum(1) / m.sum(1)


def _dist_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from pretrain.distributed.env import DistEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        env = DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0,
                      master_addr="127.0.0.1", master_port=0, launcher="torchrun")
        model = _Toy()
        full = _batch(8, seed=3)
        half = {k: v[rank * 4:(rank + 1) * 4] for k, v in full.items()}
        cfg = ObjectiveConfig(mlm=None, nt_xent=None, arccon=ArcConConfig(gather=True),
                              consistency=ConsistencyConfig(weight=0.5))
        ctx = Context(env=env, ops=OpsConfig(similarity="torch", chunk_size=3), pooling="mean", stage="sentences")
        loss, _ = Objective(cfg, ctx)(model, half)
        loss.backward()
        torch.save({"loss": loss.detach(), "grad": model.emb.weight.grad, "pgrad": model.projection.weight.grad},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gathered_pair_terms_match_single_process(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_dist_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = _Toy()
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, arccon=ArcConConfig(gather=True),
                          consistency=ConsistencyConfig(weight=0.5))
    ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling="mean", stage="sentences")
    loss, _ = Objective(cfg, ctx)(model, _batch(8, seed=3))
    loss.backward()
    # DeepSpeed averages gradients over ranks; each rank's loss is scaled by world / global count.
    assert float((res[0]["loss"] + res[1]["loss"]) / 2) == pytest.approx(loss.item(), rel=1e-7)
    torch.testing.assert_close((res[0]["grad"] + res[1]["grad"]) / 2, model.emb.weight.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close((res[0]["pgrad"] + res[1]["pgrad"]) / 2, model.projection.weight.grad,
                               rtol=1e-6, atol=1e-9)


def test_spread_metrics_against_a_pairwise_loop_and_on_collapse():
    """emb_cos / uniform against a float64 loop over pairs of different sentences; a collapsed batch (every row
    the same vector) reads emb_cos 1 and uniform 0, a spread one far from both."""
    import math

    from pretrain.objective.terms import spread_metrics

    g = torch.Generator().manual_seed(0)
    z_a, z_b = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    got = spread_metrics(z_a, z_b)
    rows = [r / r.norm() for r in torch.cat([z_a, z_b]).double()]
    cos, ker = [], []
    for i in range(12):
        for j in range(12):
            if i % 6 != j % 6:
                cos.append(float(rows[i] @ rows[j]))
                ker.append(math.exp(-2 * float(((rows[i] - rows[j]) ** 2).sum())))
    assert got["emb_cos"][1] == len(cos) == 12 * 10
    assert got["emb_cos"][0] / got["emb_cos"][1] == pytest.approx(sum(cos) / len(cos), abs=1e-6)
    assert got["uniform"][0] == pytest.approx(math.log(sum(ker) / len(ker)), abs=1e-5)
    same = torch.ones(4, 3) + 1e-4 * torch.randn(4, 3, generator=g)
    collapsed = spread_metrics(same, same.clone())
    assert collapsed["emb_cos"][0] / collapsed["emb_cos"][1] > 0.9999 and collapsed["uniform"][0] > -1e-4
    assert spread_metrics(z_a[:1], z_b[:1]) == {}


def test_mean_pool_warmup_blends_the_views_embedding_and_ends_at_model_pooling():
    """objective.nt_xent.mean_pool_warmup_steps: the views' embedding before projection is
    (1 - w) [CLS] + w mean with w = 1 - step/K, against a float64 reference; w = 0 is plain [CLS]."""
    from pretrain.config.objective import NTXentConfig
    from pretrain.objective import Forward
    from pretrain.objective.forward import mean_pool_mix

    assert [mean_pool_mix(s, 4) for s in (0, 1, 2, 4, 9)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    assert mean_pool_mix(0, 0) == 0.0
    with pytest.raises(ValueError, match="mean_pool_warmup_steps"):
        NTXentConfig(mean_pool_warmup_steps=-1)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_position=64,
                      dropout=0.0, attention_dropout=0.0, pooling="cls", pooler=False)
    model = build_model(cfg, seed=3).double().eval()
    b = _batch()
    views = {"view_a_ids": b["input_ids"], "view_a_mask": b["attention_mask"],
             "view_b_ids": b["input_ids"].flip(0), "view_b_mask": b["attention_mask"].flip(0)}
    h = model.encode(torch.cat([views["view_a_ids"], views["view_b_ids"]]),
                     torch.cat([views["view_a_mask"], views["view_b_mask"]]))
    mask = torch.cat([views["view_a_mask"], views["view_b_mask"]]).double()
    cls_e, mean_e = h[:, 0], (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    for w in (0.0, 0.25, 1.0):
        ctx = Context(env=ENV, ops=OpsConfig(), pooling="cls", view_mean_mix=w)
        z_a, z_b = Forward(model, views, ctx).view_projections()
        want = model.projection((1 - w) * cls_e + w * mean_e)
        torch.testing.assert_close(torch.cat([z_a, z_b]), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recipe", ["arccse_bert_base", "rankcse_listnet_bert_base", "rankcse_listmle_bert_base",
                                    "simcse_unsup_bert_base", "simcse_sup_bert_base"])
def test_sentence_recipes_train_on_the_mlp_output_over_cls(repo_root, recipe):
    """ArcCSE Sec. 4.1 ("the output of the MLP layer on top of the [CLS] as the sentence representation during
    training") and RankCSE App. A ("following SimCSE"), and SimCSE's own recipes: the embedding the contrastive and
    ranking terms compare is SimCSE's MLP, one dense layer + tanh over [CLS], which the recipes say is BERT's pooler.
    Float64 reference tanh(W h_cls + b) against the pair the terms read, with the recipe's model.pooling/pooler/
    projection settings. Until 2026-12-06 the recipes' one-layer projection added a Linear after that MLP."""
    from pretrain.config import load_run_config
    from pretrain.objective import Forward

    m = load_run_config(repo_root / "configs" / "recipes" / f"{recipe}.yaml").model
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_position=64,
                      dropout=0.0, attention_dropout=0.0, pooling=m.pooling, pooler=m.pooler,
                      projection_layers=m.projection_layers, projection_activation=m.projection_activation)
    model = build_model(cfg, seed=4).double()
    batch = _batch()
    ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling=m.pooling, stage="sentences")
    z1, _ = Forward(model, batch, ctx).pair()
    with torch.no_grad():
        h_cls = model.encode(batch["sentence_ids"], batch["sentence_mask"])[:, 0]
        dense = model.pooler.dense
        want = torch.tanh(h_cls @ dense.weight.T + dense.bias)
    torch.testing.assert_close(z1.detach(), want, rtol=1e-10, atol=1e-12)
