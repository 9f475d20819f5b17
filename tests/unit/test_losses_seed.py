"""Seed objectives (InfoNCE, ArcCon, triplet, RankCSE ranking, SARCSE reconstruction) vs float64 references.

Every reference below is written independently of pretrain.losses: plain Python loops
over rows with math.* or per-row float64 tensors, differentiated by autograd.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.losses.arccon import arccon
from pretrain.losses.info_nce import info_nce
from pretrain.losses.ranking import (
    cosine_matrix,
    drop_positive,
    js_consistency,
    listmle,
    listnet,
    mix_teacher_sims,
)
from pretrain.losses.reconstruction import frequency_weights, reconstruction_loss
from pretrain.losses.triplet import dropout_off, triplet_entailment
from pretrain.training.resources import load_token_freq

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaf(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=F64) * scale).requires_grad_(True)


def _cos(a, b):
    return (a @ b) / (a.norm() * b.norm())


# ---------------------------------------------------------------- InfoNCE / ArcCon references


def _ref_info_nce(q, k, pos, tau, margin=0.0, self_idx=None):
    """Row by row: -log(e^{g(cos_pos)/tau} / sum_j e^{l_j/tau}), g = cos(acos + m) via math.acos."""
    total = q.new_zeros(())
    for i in range(q.shape[0]):
        logits = []
        for j in range(k.shape[0]):
            if self_idx is not None and j == int(self_idx[i]):
                continue
            c = _cos(q[i], k[j])
            if j == int(pos[i]) and margin:
                c = torch.cos(torch.acos(c) + margin)  # reference away from theta = 0, pi only
            logits.append(c / tau)
        logits = torch.stack(logits)
        pos_j = int(pos[i]) - (1 if self_idx is not None and int(self_idx[i]) < int(pos[i]) else 0)
        total = total - (logits[pos_j] - torch.log(torch.exp(logits).sum()))
    return total


@pytest.mark.parametrize("impl", ["eager", "torch"])
@pytest.mark.parametrize("margin_deg", [0.0, 10.0])
def test_info_nce_matches_float64_reference_values_and_grads(margin_deg, impl):
    n, m, d = 5, 9, 7
    q, k = _leaf(n, d, seed=1), _leaf(m, d, seed=2)
    pos = torch.tensor([3, 0, 8, 5, 1])
    loss, count, metrics = info_nce(q, k, pos, temperature=0.05, margin=math.radians(margin_deg), impl=impl,
                                    chunk_size=4)
    ref = _ref_info_nce(q, k, pos, 0.05, math.radians(margin_deg))
    assert count == n
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    gq, gk = torch.autograd.grad(loss, (q, k))
    rq, rk = torch.autograd.grad(ref, (q, k))
    torch.testing.assert_close(gq, rq, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gk, rk, rtol=1e-8, atol=1e-10)
    pos_cos = sum(float(_cos(q[i], k[pos[i]]).detach()) for i in range(n))
    assert metrics["pos_cos"][0].item() == pytest.approx(pos_cos, rel=1e-10)


def test_info_nce_self_exclusion_nt_xent_layout():
    # 2N views against themselves: row i's positive is its partner, its own column is dropped.
    n, d = 4, 6
    z = _leaf(2 * n, d, seed=3)
    pos = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    self_idx = torch.arange(2 * n)
    loss, count, _ = info_nce(z, z, pos, temperature=0.1, self_idx_N=self_idx)
    ref = _ref_info_nce(z, z, pos, 0.1, self_idx=self_idx)
    assert count == 2 * n
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], torch.autograd.grad(ref, z)[0], rtol=1e-8, atol=1e-10)


def test_info_nce_float32_inputs_close_to_float64():
    q, k = _leaf(6, 8, seed=4), _leaf(6, 8, seed=5)
    pos = torch.arange(6)
    lo, _, _ = info_nce(q.detach().float(), k.detach().float(), pos, temperature=0.05)
    hi, _, _ = info_nce(q.detach(), k.detach(), pos, temperature=0.05)
    assert lo.dtype == torch.float32
    assert lo.item() == pytest.approx(hi.item(), rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        info_nce(q, k, pos, temperature=0.0)


def test_arccon_margin_zero_is_info_nce_exactly():
    q, k = _leaf(6, 5, seed=6), _leaf(6, 5, seed=7)
    pos = torch.tensor([1, 0, 3, 2, 5, 4])
    a, _, _ = arccon(q, k, pos, temperature=0.05, margin_deg=0.0)
    b, _, _ = info_nce(q, k, pos, temperature=0.05)
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, q)[0], torch.autograd.grad(b, q)[0])


def test_arccon_margin_raises_loss_and_matches_degrees():
    q, k = _leaf(6, 5, seed=8), _leaf(6, 5, seed=9)
    pos = torch.arange(6)
    with_m, _, _ = arccon(q, k, pos, temperature=0.05, margin_deg=10.0)
    without, _, _ = arccon(q, k, pos, temperature=0.05, margin_deg=0.0)
    assert with_m.item() > without.item()
    ref = _ref_info_nce(q, k, pos, 0.05, math.radians(10.0))
    torch.testing.assert_close(with_m, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_arccon_finite_at_theta_zero_and_pi(sign):
    base = torch.randn(4, 8, generator=_gen(10), dtype=torch.float32)
    q = base.clone().requires_grad_(True)
    k = (sign * base).clone().requires_grad_(True)  # cos(q_i, k_i) = +-1 exactly
    loss, _, _ = arccon(q, k, torch.arange(4), temperature=0.05, margin_deg=10.0)
    gq, gk = torch.autograd.grad(loss, (q, k))
    assert torch.isfinite(loss) and torch.isfinite(gq).all() and torch.isfinite(gk).all()
    # value at the edge is still cos(theta + m): theta = 0 -> cos m, theta = pi -> -cos m
    want = -math.log(math.exp(math.cos(math.radians(10)) * sign / 0.05) / (
        math.exp(math.cos(math.radians(10)) * sign / 0.05)
        + sum(math.exp(float(torch.nn.functional.cosine_similarity(base[0], sign * base[j], dim=0)) / 0.05)
              for j in range(1, 4))))
    one, _, _ = arccon(q[:1].detach(), k.detach(), torch.tensor([0]), temperature=0.05, margin_deg=10.0)
    assert one.item() == pytest.approx(want, rel=1e-4, abs=1e-5)


# ---------------------------------------------------------------- triplet


def test_triplet_matches_reference_values_and_grads():
    h, h1, h2 = _leaf(6, 5, seed=13), _leaf(6, 5, seed=14), _leaf(6, 5, seed=15)
    for margin in (0.0, 0.3):
        loss, count, metrics = triplet_entailment(h, h1, h2, margin=margin)
        ref = sum(torch.clamp(_cos(h[i], h2[i]) - _cos(h[i], h1[i]) + margin, min=0) for i in range(6))
        assert count == 6
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad(loss, (h, h1, h2))
        want = torch.autograd.grad(ref, (h, h1, h2))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    ok = sum(float(_cos(h[i], h1[i]) > _cos(h[i], h2[i])) for i in range(6))
    assert metrics["order_acc"][0].item() == ok


def test_triplet_empty_batch_is_zero_with_graph():
    h = torch.zeros(0, 4, requires_grad=True)
    loss, count, _ = triplet_entailment(h, h, h)
    assert count == 0 and loss.item() == 0.0 and loss.requires_grad


def test_dropout_off_is_deterministic_and_restores_flags():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))
    net.train()
    net[2].eval()  # a mixed state must come back exactly
    x = torch.randn(4, 8)
    with dropout_off(net):
        assert not any(m.training for m in net.modules())
        a, b = net(x), net(x)
        ref = net[2][0](net[0](x))  # the same network without dropout, composed by hand
    assert torch.equal(a, b) and torch.allclose(a, ref)
    assert a.requires_grad  # still differentiable
    assert net.training and net[1].training and not net[2].training and not net[2][1].training
    assert not torch.equal(net[1](x), net[1](x))  # dropout active again after the block


def test_dropout_off_with_pretrain_model():
    model_pkg = pytest.importorskip("pretrain.model")
    if not hasattr(model_pkg, "PretrainModel"):
        pytest.skip("pretrain.model.PretrainModel has not landed yet")
    from pretrain.config.model import ModelConfig

    PretrainModel = model_pkg.PretrainModel

    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_position=16,
                      dropout=0.3, attention_dropout=0.3)
    model = PretrainModel(cfg)
    model.train()
    ids = torch.randint(5, 50, (3, 10), generator=_gen(16))
    mask = torch.ones(3, 10, dtype=torch.long)
    assert not torch.equal(model.encode(ids, mask), model.encode(ids, mask))  # dropout on in training
    with dropout_off(model):
        a, b = model.encode(ids, mask), model.encode(ids, mask)
    assert torch.equal(a, b)
    assert model.training


# ---------------------------------------------------------------- RankCSE ranking


def _softmax_row(xs, tau):
    mx = max(xs)
    e = [math.exp((x - mx) / tau) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def test_js_consistency_matches_reference_and_is_zero_for_identical_lists():
    a, b = _leaf(4, 6, seed=17, scale=0.3), _leaf(4, 6, seed=18, scale=0.3)
    loss, count, _ = js_consistency(a, b, temperature=0.05)
    ref = a.new_zeros(())
    for i in range(4):
        p = torch.softmax(a[i] / 0.05, 0)
        q = torch.softmax(b[i] / 0.05, 0)
        mid = (p + q) / 2
        ref = ref + 0.5 * ((p * torch.log(p / mid)).sum() + (q * torch.log(q / mid)).sum())
    assert count == 4
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    for x, y in zip(torch.autograd.grad(loss, (a, b)), torch.autograd.grad(ref, (a, b))):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-12)
    same, _, _ = js_consistency(a, a.detach().clone(), temperature=0.05)
    assert abs(same.item()) < 1e-12
    swapped, _, _ = js_consistency(b, a, temperature=0.05)
    assert swapped.item() == pytest.approx(loss.item(), rel=1e-12)
    assert 0 < loss.item() <= 4 * math.log(2) + 1e-12


def test_js_consistency_survives_peaked_distributions():
    a = torch.tensor([[1.0, -1.0, -1.0], [0.0, 1.0, 0.0]], requires_grad=True)
    b = torch.tensor([[-1.0, 1.0, -1.0], [0.0, 1.0, 0.0]], requires_grad=True)
    loss, _, _ = js_consistency(a, b, temperature=0.001)  # softmax underflows to exact 0/1
    (g,) = torch.autograd.grad(loss, a)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert loss.item() == pytest.approx(math.log(2), rel=1e-5)


def test_listnet_matches_reference_with_positive_excluded():
    n, m = 4, 7
    s, t = _leaf(n, m, seed=19, scale=0.4), torch.randn(n, m, generator=_gen(20), dtype=F64) * 0.4
    pos = torch.tensor([2, 0, 6, 3])
    loss, count, _ = listnet(s, t, student_temperature=0.025, teacher_temperature=0.0125, pos_idx_N=pos)
    ref = s.new_zeros(())
    for i in range(n):
        keep = [j for j in range(m) if j != int(pos[i])]
        target = _softmax_row([float(t[i, j]) for j in keep], 0.0125)
        logp = torch.log_softmax(s[i, keep] / 0.025, 0)
        ref = ref - sum(target[c] * logp[c] for c in range(m - 1))
    assert count == n
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, s)[0], torch.autograd.grad(ref, s)[0], rtol=1e-8, atol=1e-12)
    # without exclusion the positive column counts again, so the value changes
    full, _, _ = listnet(s, t, student_temperature=0.025, teacher_temperature=0.0125)
    assert abs(full.item() - loss.item()) > 1e-6


def test_listnet_teacher_gets_no_gradient():
    s = _leaf(3, 5, seed=21)
    t = _leaf(3, 5, seed=22)
    loss, _, _ = listnet(s, t)
    loss.backward()
    assert t.grad is None and s.grad is not None


def _ref_listmle_row(scores, order, tau):
    """-log prod_k e^{s_pi(k)} / sum_{j>=k} e^{s_pi(j)} with plain math."""
    s = [scores[o] / tau for o in order]
    total = 0.0
    for k in range(len(s)):
        mx = max(s[k:])
        total += mx + math.log(sum(math.exp(x - mx) for x in s[k:])) - s[k]
    return total


def test_listmle_matches_reference_and_prefers_teacher_order():
    n, m = 3, 6
    s, t = _leaf(n, m, seed=23, scale=0.5), torch.randn(n, m, generator=_gen(24), dtype=F64)
    pos = torch.tensor([0, 5, 2])
    loss, count, _ = listmle(s, t, temperature=0.05, pos_idx_N=pos)
    ref = 0.0
    for i in range(n):
        keep = [j for j in range(m) if j != int(pos[i])]
        order = sorted(range(len(keep)), key=lambda c: -float(t[i, keep[c]]))
        ref += _ref_listmle_row([float(s[i, j].detach()) for j in keep], order, 0.05)
    assert count == n
    assert loss.item() == pytest.approx(ref, rel=1e-10)
    # gradient against autograd through a loop-written Plackett-Luce likelihood
    ref_t = s.new_zeros(())
    for i in range(n):
        order = torch.argsort(t[i], descending=True)
        x = s[i, order] / 0.07
        for k in range(m):
            ref_t = ref_t + torch.logsumexp(x[k:], 0) - x[k]
    got, _, _ = listmle(s, t, temperature=0.07)
    torch.testing.assert_close(torch.autograd.grad(got, s)[0], torch.autograd.grad(ref_t, s)[0], rtol=1e-8, atol=1e-12)

    teacher = torch.arange(m, 0, -1, dtype=F64)[None]  # teacher ranks column 0 first
    in_order = torch.linspace(1.0, -1.0, m, dtype=F64)[None]
    reversed_ = in_order.flip(-1)
    l_in, _, _ = listmle(in_order, teacher, temperature=0.05)
    l_rev, _, _ = listmle(reversed_, teacher, temperature=0.05)
    assert l_in.item() < 0.1 < l_rev.item()
    assert l_in.item() == pytest.approx(_ref_listmle_row(in_order[0].tolist(), list(range(m)), 0.05), rel=1e-10)


def test_teacher_mixing_drop_positive_and_cosine_matrix():
    s1, s2 = torch.randn(3, 4, generator=_gen(25)), torch.randn(3, 4, generator=_gen(26))
    mixed = mix_teacher_sims([s1, s2], [1 / 3, 2 / 3])
    torch.testing.assert_close(mixed, s1 / 3 + 2 * s2 / 3)
    with pytest.raises(ValueError, match="sum to 1"):
        mix_teacher_sims([s1, s2], [0.5, 0.6])
    x = torch.arange(12.0).view(3, 4)
    assert drop_positive(x, torch.tensor([0, 3, 1])).tolist() == [[1, 2, 3], [4, 5, 6], [8, 10, 11]]
    a, b = torch.randn(3, 5, generator=_gen(27), dtype=F64), torch.randn(4, 5, generator=_gen(28), dtype=F64)
    cm = cosine_matrix(a, b)
    assert cm[1, 2].item() == pytest.approx(float(_cos(a[1], b[2])), rel=1e-12)


# ---------------------------------------------------------------- SARCSE reconstruction


def test_frequency_weights_formula():
    freq = torch.tensor([0.5, 0.0, 0.01, 0.001, 0.489], dtype=F64)
    ids = torch.tensor([[0, 1, 2], [3, 4, 1]])
    w = frequency_weights(ids, freq, theta=0.1, lam=50.0)
    want = [max(0.1, 1 - 50 * float(freq[i])) for row in ids.tolist() for i in row]
    assert w.flatten().tolist() == pytest.approx(want)
    assert w.dtype == F64 and w.min().item() == pytest.approx(0.1)


def test_reconstruction_loss_matches_reference():
    b, t, d = 3, 5, 4
    x, r = _leaf(b, t, d, seed=29), _leaf(b, t, d, seed=30)
    w = torch.rand(b, t, generator=_gen(31), dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    loss, count, metrics = reconstruction_loss(x, r, w, mask)
    ref = x.new_zeros(())
    for i in range(b):
        n = int(mask[i].sum())
        if n:
            ref = ref + sum(w[i, j] * ((x[i, j] - r[i, j]) ** 2).mean() for j in range(n)) / n
    assert count == 2
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for a, c in zip(torch.autograd.grad(loss, (x, r)), torch.autograd.grad(ref, (x, r))):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    assert metrics["mse"][1] == 7
    detached, _, _ = reconstruction_loss(x, r, w, mask, detach_target=True)
    assert torch.autograd.grad(detached, x, allow_unused=True)[0] is None


def test_load_token_freq(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="pretrain-preprocess"):
        load_token_freq(tmp_path)
    freq = np.array([0.25, 0.25, 0.5])
    np.save(tmp_path / "token_freq.npy", freq)
    out = load_token_freq(tmp_path, vocab_size=3)
    assert out.dtype == F64 and out.tolist() == freq.tolist()
    with pytest.raises(ValueError, match="vocabulary"):
        load_token_freq(tmp_path / "token_freq.npy", vocab_size=4)
    np.save(tmp_path / "bad.npy", np.array([0.5, 0.6]))
    with pytest.raises(ValueError, match="sum to 1"):
        load_token_freq(tmp_path / "bad.npy")


# ---------------------------------------------------------------- recipes


RECIPES = [
    "simcse_unsup_bert_base", "simcse_sup_bert_base", "arccse_bert_base", "rankcse_listnet_bert_base",
    "rankcse_listmle_bert_base", "sarcse_roberta_base", "clear_del_word", "clear_del_span", "clear_subs_del_span", "clear_del_span_reorder",
]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_strictly(repo_root: Path, name: str):
    from pretrain.config import load_run_config

    path = repo_root / "configs" / "recipes" / f"{name}.yaml"
    text = path.read_text()
    assert "Table" in text or "Sec" in text, "each recipe cites where its numbers come from"
    cfg = load_run_config(path)
    obj = cfg.objective
    if name.startswith("clear_"):
        assert obj.enabled() == ["mlm", "nt_xent"]
    else:
        assert obj.mlm is None and obj.nt_xent is None
    if name == "arccse_bert_base":
        assert obj.arccon.margin_deg == 10.0 and obj.arccon.temperature == 0.05 and obj.triplet.weight == 0.1
    if name.startswith("rankcse"):
        assert obj.rank_distill.method == name.split("_")[1] and len(obj.rank_distill.teachers) == 2
    if name == "simcse_sup_bert_base":
        assert cfg.data.pairs and not cfg.data.sentences and obj.info_nce.hard_negative_weight == 1.0
        assert (cfg.optim.lr, cfg.train.micro_batch_size, cfg.eval.pooling) == (5e-5, 512, "cls")
    if name == "sarcse_roberta_base":
        assert obj.reconstruction.weight == 2.5e-4 and obj.info_nce.weight == 1.0


@pytest.fixture(params=["c", "torch"])
def mlm_path(request, monkeypatch):
    """mlm_loss's CPU cross-entropy: the C kernel (``_FusedCrossEntropy``) or torch's ops (``_SummedCrossEntropy``)."""
    from pretrain.losses import mlm

    if request.param == "torch":
        monkeypatch.setattr(mlm, "_fused", lambda logits, labels: False)
    elif mlm.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlm_accuracy_counts_the_rows_whose_label_has_the_largest_logit(dtype, mlm_path):
    """mlm_loss's correct count against a loop over rows: a row is right when no logit exceeds its label's (a tie
    for the top counts), wrong otherwise, NaN rows and unlabelled ones (-100, bucketed padding) wrong; the loss is
    the summed float64 cross-entropy of the labelled rows."""
    from pretrain.losses.mlm import mlm_loss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen).to(dtype)
    labels = torch.randint(0, 50, (64,), generator=gen)
    labels[:20] = logits[:20].float().argmax(-1)  # some right
    labels[20] = 49  # a tie for the top between the label and an earlier entry (argmax would say 0: wrong)
    logits[20, 0] = logits[20, 49] = logits[20].max() + 1
    logits[21] = float("nan")
    logits[23, 7] = float("nan")  # one NaN in a row whose label may otherwise be its top
    labels[23] = logits[23].float().nan_to_num(-1e9).argmax()
    labels[[0, 22]] = -100  # row 0 would be right if labelled
    loss, count, metrics = mlm_loss(logits, labels)
    want = sum(1 for row, y in zip(logits.float().tolist(), labels.tolist())
               if y >= 0 and not any(math.isnan(v) for v in row) and all(v <= row[y] for v in row))
    assert 20 <= want < 62  # rows 1-19 and the tie, and any the random logits got right
    assert int(metrics["mlm_acc"][0]) == want and count == metrics["mlm_acc"][1] == 64
    assert torch.isnan(loss)  # the NaN row poisons the sum, as it should (the step's finite check skips it)
    finite = [r for r in range(64) if r not in (21, 23)]
    loss_ok, _, _ = mlm_loss(logits[finite], labels[finite])
    ref = sum(-torch.log_softmax(logits[r].double(), -1)[labels[r]] for r in finite if labels[r] >= 0)
    assert abs(float(loss_ok) - float(ref)) < 1e-4 * float(ref)


@pytest.mark.parametrize("vocab", [301, 30522])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlm_loss_and_its_gradient_are_torchs_cross_entropy_in_float64(dtype, vocab, mlm_path):
    """On the CPU mlm_loss takes its own cross-entropy (the C kernel's, or ``_SummedCrossEntropy``: the
    log-softmax turned into the gradient in place); loss and logit gradient against F.cross_entropy in float64,
    unlabelled rows (-100), a -inf logit and a gradient other than 1 included; the gradient in the logits' dtype.
    A vocabulary that the C kernel's 16 lanes do not divide, and BERT's."""
    from pretrain.losses.mlm import mlm_loss

    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(37, vocab, generator=gen) * 4).to(dtype)
    base[5, 17] = float("-inf")
    labels = torch.randint(0, vocab, (37,), generator=gen)
    labels[[2, 11, 30]] = -100
    logits = base.clone().requires_grad_()
    loss, _, _ = mlm_loss(logits, labels)
    (grad,) = torch.autograd.grad(loss * 0.37, logits)
    x64 = base.double().requires_grad_()
    ref = F.cross_entropy(x64, labels, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref * 0.37, x64)
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5 * float(ref.detach())
    assert grad.dtype == dtype and grad[[2, 11, 30]].abs().max() == 0
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # fp32 and bf16 rounding of gradients up to 0.37
    assert (grad.double() - ref_grad).abs().max() < tol
    if dtype == torch.float32:  # every element, however small, to a few float32 roundings of x - lse (|x - lse| ~ 40)
        assert ((grad.double() - ref_grad).abs() <= 1e-12 + 2e-5 * ref_grad.abs()).all()


def test_an_mlm_label_beyond_the_vocabulary_is_an_error(mlm_path):
    """A label >= V (data tokenized with another vocabulary) is refused, not ignored: the C kernel counts them and
    mlm_loss says what is wrong; torch's path fails in its gather. Negative labels stay ignored."""
    from pretrain.losses.mlm import mlm_loss

    logits = torch.randn(4, 10, requires_grad=True)
    assert torch.isfinite(mlm_loss(logits, torch.tensor([1, -100, 3, 4]))[0])
    with pytest.raises((ValueError, IndexError, RuntimeError)) as err:
        mlm_loss(logits, torch.tensor([1, 2, 10, 3]))
    if mlm_path == "c":
        assert "vocabulary size 10" in str(err.value) and "1 MLM label" in str(err.value)


def test_logits_and_labels_of_different_row_counts_are_an_error(mlm_path):
    """A label count other than the logits' row count is refused, as F.cross_entropy refuses it: the C kernel reads
    one int64 label per logit row, so with fewer labels it would read past their buffer (garbage labels), and with
    more it would silently ignore the extra ones."""
    from pretrain.losses.mlm import mlm_loss

    labels = torch.tensor([1, 2, 3])
    for rows in (2, 5):
        logits = torch.randn(rows, 10, requires_grad=True)
        with pytest.raises((ValueError, IndexError, RuntimeError)) as err:
            mlm_loss(logits, labels)
        assert "vocabulary" not in str(err.value)  # not labels read from past the buffer
