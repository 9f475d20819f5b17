"""The objectives at the edges a real run meets: one sentence per rank, configurations that would pass validation
and fail (or quietly do something else) at the first step, the losses' gradients against float64 finite differences,
the cached step against the plain one at equal batch, and the chunked similarity path's peak memory.
Legend: N rows, M columns (keys), D embedding dim, C column chunk.
"""

from __future__ import annotations

import math
from pathlib import Path

import grad_cache_reference as R
import pytest
import torch
import torch.nn.functional as F

from pretrain.config.objective import (
    ArcConConfig,
    InfoNCEConfig,
    MatryoshkaConfig,
    NTXentConfig,
    ObjectiveConfig,
    RankDistillConfig,
    TripletConfig,
)
from pretrain.config.train import OpsConfig
from pretrain.losses.info_nce import info_nce
from pretrain.losses.nt_xent import nt_xent
from pretrain.losses.ranking import cosine_matrix, js_consistency, listmle, listnet
from pretrain.losses.reconstruction import reconstruction_loss
from pretrain.losses.triplet import triplet_entailment
from pretrain.objective import Context, Objective, Teachers, TrainModule

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- one sentence per rank


def test_listnet_on_a_list_emptied_by_the_positive_is_zero_not_an_error():
    """One sentence per rank without gathering: the list is its positive alone, which exclude_positive drops. The
    top-1 metric took argmax of an empty row (IndexError) and the RankCSE step crashed."""
    student = torch.tensor([[0.3]], dtype=torch.float64, requires_grad=True)
    loss, count, metrics = listnet(student, torch.tensor([[0.9]], dtype=torch.float64), pos_idx_N=torch.tensor([0]))
    loss.backward()
    assert float(loss) == 0.0 and count == 1 and float(student.grad.abs().sum()) == 0.0
    assert float(metrics["top1_agree"][0]) == 0.0 and float(metrics["kl"][0]) == 0.0


def _ref_listnet(s_NM, t_NM, pos_N, tau_s, tau_t) -> float:
    """Top-one ListNet with the positive dropped, float64 loops."""
    total = 0.0
    for i in range(s_NM.shape[0]):
        cols = [j for j in range(s_NM.shape[1]) if j != int(pos_N[i])]
        s = [float(s_NM[i, j]) / tau_s for j in cols]
        t = [float(t_NM[i, j]) / tau_t for j in cols]
        ls, lt = math.log(sum(math.exp(x - max(s)) for x in s)) + max(s), math.log(
            sum(math.exp(x - max(t)) for x in t)) + max(t)
        total -= sum(math.exp(b - lt) * (a - ls) for a, b in zip(s, t))
    return total


def test_listnet_with_lists_of_one_to_three_columns_matches_float64():
    """Lists of 2-4 columns (small per-rank batches) with the positive dropped: the loss as the float64 loop."""
    gen = torch.Generator().manual_seed(3)
    for m in (2, 3, 4):
        s = torch.randn(m, m, generator=gen, dtype=torch.float64)
        t = torch.randn(m, m, generator=gen, dtype=torch.float64)
        pos = torch.arange(m)
        got, _, _ = listnet(s, t, student_temperature=0.5, teacher_temperature=0.25, pos_idx_N=pos)
        assert float(got) == pytest.approx(_ref_listnet(s, t, pos, 0.5, 0.25), rel=1e-12)


@pytest.mark.parametrize("case", list(R.CASES))
@pytest.mark.parametrize("rows", [1, 5])
def test_the_cached_step_equals_the_plain_step_at_equal_batch(case, rows):
    """grad_accum = 1: the cached step (one chunk) and the plain forward/backward of the same micro-batch give the
    same loss and gradient (dropout off: the two draw their masks in another order). One row per rank included,
    where RankCSE's ListNet list is empty."""
    module = R.case_module(case, dropout=0.0)
    chunk = R.split_chunks(R.step_batch(R.CASES[case][0], rows), [rows])[0]
    got, got_loss = R.cached_grads(module, [chunk])
    module.zero_grad(set_to_none=True)
    loss, _ = module(chunk)
    loss.backward()
    assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    assert R.mismatch(got, R.param_grads(module)) == []


# ----------------------------------------------------------------------------- configurations refused up front


def _ctx(stage: str) -> Context:
    return Context(env=R.ONE, ops=OpsConfig(similarity="eager"), pooling="mean", stage=stage)


def test_info_nce_and_arccon_gathering_differently_is_refused():
    """Both read one pair with one set of keys (Objective.gather came from info_nce alone): arccon.gather=false
    beside info_nce.gather=true was ignored without a word."""
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(gather=True),
                          arccon=ArcConConfig(gather=False))
    with pytest.raises(ValueError, match="objective.arccon.gather"):
        Objective(cfg, _ctx("sentences"))
    same = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(gather=False),
                           arccon=ArcConConfig(gather=False))
    assert not Objective(same, _ctx("sentences")).gather


@pytest.mark.parametrize("stage, terms, match", [
    ("sentences", {"nt_xent": NTXentConfig(), "info_nce": InfoNCEConfig()}, "objective.nt_xent"),
    ("pretrain", {"nt_xent": NTXentConfig(), "arccon": ArcConConfig(), "triplet": TripletConfig()},
     "objective.triplet"),
])
def test_a_term_whose_inputs_the_stage_does_not_make_is_refused_when_built(stage, terms, match):
    """nt_xent in the sentence stage (no CLEAR views) and triplet in pretraining (no triplet views) passed every
    check and failed at the first step's forward."""
    with pytest.raises(ValueError, match=match):
        Objective(ObjectiveConfig(mlm=None, **terms), _ctx(stage))


def test_matryoshka_sizes_beyond_the_embedding_are_refused_when_built():
    """A size larger than the sentence embedding failed in the first step's forward (first_coordinates)."""
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(), matryoshka=MatryoshkaConfig(dims=[32, 8]))
    model = R.tiny_model(1, dropout=0.0)  # hidden 16
    with pytest.raises(ValueError, match=r"matryoshka.dims has 32, larger"):
        TrainModule(model, Objective(cfg, _ctx("sentences")))
    ok = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(), matryoshka=MatryoshkaConfig(dims=[16, 8]))
    TrainModule(model, Objective(ok, _ctx("sentences")))


@pytest.mark.parametrize("max_len", [0, 1])
def test_teacher_max_len_below_cls_and_sep_is_refused(max_len):
    """teacher_max_len=0 failed at the first step (an index into an empty row), 1 fed the teachers [SEP] alone."""
    cfg = RankDistillConfig(teachers=["t"], teacher_max_len=max_len)
    with pytest.raises(ValueError, match="teacher_max_len"):
        Teachers(cfg, models=[R.tiny_model(7, dropout=0.0)])


def test_a_teacher_with_another_vocabulary_is_refused_when_built():
    """A RankCSE teacher of another tokenizer failed at the first step (after the data and DeepSpeed had started);
    the module refuses it when the run is built, naming the teacher."""
    import dataclasses

    from pretrain.model import build_model

    student, teacher = R.tiny_model(1, dropout=0.0), R.tiny_model(7, dropout=0.0)
    other = build_model(dataclasses.replace(teacher.cfg, vocab_size=teacher.cfg.vocab_size + 8), seed=7)
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(),
                          rank_distill=RankDistillConfig(teachers=["t_same", "t_other"]))
    with pytest.raises(ValueError, match=r"teacher t_other has vocabulary size \d+, the student"):
        TrainModule(student, Objective(cfg, _ctx("sentences"), teachers=Teachers(cfg.rank_distill,
                                                                                  models=[teacher, other])))
    same = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(),
                           rank_distill=RankDistillConfig(teachers=["t_same"]))
    TrainModule(student, Objective(same, _ctx("sentences"), teachers=Teachers(same.rank_distill, models=[teacher])))


def test_the_sarcse_recipe_selects_its_best_weights_by_z(repo_root: Path, tmp_path, monkeypatch):
    """The recipe promises STS-B dev model selection by Z (SARCSE Sec. 2.2); its eval.pooling=cls_before_pooler made
    the keep-best evaluator embed by [CLS] instead."""
    import pretrain.eval.sts as sts
    import pretrain.training.evaluation as evaluation
    from pretrain.config import load_run_config
    from pretrain.model.autoencoder import AUTOENCODER_Z

    monkeypatch.setattr(evaluation, "stsb_data_dir", lambda cfg, zero_stage: str(tmp_path))
    monkeypatch.setattr(sts, "StsbDevEvaluator", lambda data_dir: None)
    cfg = load_run_config(repo_root / "configs" / "recipes" / "sarcse_roberta_base.yaml")
    keep = evaluation.StsbKeepBest(cfg.eval, run_dir=tmp_path, tokenizer=None, tokenizer_path="",
                                   model_pooling=cfg.model.pooling, zero_stage=0, is_main=False,
                                   autoencoder=cfg.objective.reconstruction is not None)
    assert keep.pooling == AUTOENCODER_Z


def test_a_resume_compares_only_with_a_readable_best_of_the_same_pooling(repo_root: Path, tmp_path, monkeypatch):
    """best/best.json cut by a full disk stopped the resume with a traceback (json.loads unguarded); one selected by
    another pooling (the SARCSE recipe now selects by Z, a run resumed from one that selected by [CLS]) had its
    score compared with the other embedding's. Both now start the comparison over, saying why."""
    import json

    from pretrain.config import load_run_config
    from pretrain.eval import sts
    from pretrain.training import evaluation

    monkeypatch.setattr(evaluation, "stsb_data_dir", lambda cfg, zero_stage: str(tmp_path))
    monkeypatch.setattr(sts, "StsbDevEvaluator", lambda data_dir: None)
    cfg = load_run_config(repo_root / "configs" / "recipes" / "sarcse_roberta_base.yaml")
    said: list[str] = []
    monkeypatch.setattr(evaluation, "print_progress", said.append)

    def keep():
        return evaluation.StsbKeepBest(cfg.eval, run_dir=tmp_path, tokenizer=None, tokenizer_path="",
                                       model_pooling=cfg.model.pooling, zero_stage=0, is_main=True,
                                       autoencoder=True).best

    (tmp_path / "best").mkdir()
    best_json = tmp_path / "best" / "best.json"
    best_json.write_text(json.dumps({"step": 10, "stsb_dev_spearman": 0.71, "pooling": "autoencoder_z"}))
    assert keep() == 0.71 and not said
    best_json.write_text('{"step": 10, "stsb_dev_spear')
    assert keep() == float("-inf") and "unreadable" in said[-1]
    best_json.write_text(json.dumps({"step": 10, "stsb_dev_spearman": 0.75, "pooling": "cls_before_pooler"}))
    assert keep() == float("-inf") and "selected by pooling cls_before_pooler" in said[-1]


# ----------------------------------------------------------------------------- gradients against float64


def _gradcheck_cases():
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    n, m, d = 5, 7, 4
    pos = torch.tensor([0, 2, 1, 4, 6])
    cases = {}
    for impl in ("torch", "eager"):
        for margin in (0.0, math.radians(10.0)):
            for weight in (1.0, 2.0, 0.0):
                def nce(q, k, neg, impl=impl, margin=margin, weight=weight):
                    return info_nce(q, k, pos, temperature=0.07, margin=margin, impl=impl, chunk_size=3, neg_MD=neg,
                                    neg_weight=weight)[0]
                cases[f"info_nce-{impl}-m{margin:.2f}-w{weight}"] = (nce, (leaf(n, d), leaf(m, d), leaf(m, d)))
        cases[f"nt_xent-{impl}"] = (lambda a, b, impl=impl: nt_xent(a, b, temperature=0.1, impl=impl,
                                                                    chunk_size=3)[0], (leaf(n, d), leaf(n, d)))
    teacher = torch.randn(n, m, generator=gen, dtype=torch.float64)
    cases["js"] = (lambda a, b, c, e: js_consistency(cosine_matrix(a, b), cosine_matrix(c, e), temperature=0.05)[0],
                   (leaf(n, d), leaf(m, d), leaf(n, d), leaf(m, d)))
    cases["listnet"] = (lambda a, b: listnet(cosine_matrix(a, b), teacher, pos_idx_N=pos)[0], (leaf(n, d), leaf(m, d)))
    cases["listmle"] = (lambda a, b: listmle(cosine_matrix(a, b), teacher, pos_idx_N=pos)[0], (leaf(n, d), leaf(m, d)))
    cases["triplet"] = (lambda a, b, c: triplet_entailment(a, b, c, margin=0.3)[0],
                        (leaf(n, d), leaf(n, d), leaf(n, d)))
    mask = torch.rand(n, 6, generator=gen) > 0.3
    mask[0] = False  # a sentence without content tokens
    weight_NT = torch.rand(n, 6, generator=gen, dtype=torch.float64)
    cases["reconstruction"] = (lambda x, r: reconstruction_loss(x, r, weight_NT, mask)[0],
                               (leaf(n, 6, 3), leaf(n, 6, 3)))
    return cases


GRADCHECK = _gradcheck_cases()


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_loss_gradients_match_float64_finite_differences(name):
    """Every loss's backward (the chunked path's own autograd, the margin's, the hard-negative reweighting's) against
    central differences of its float64 forward."""
    fn, inputs = GRADCHECK[name]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- memory of the chunked path


def _peak_bytes(fn) -> int:
    """The largest amount of CPU memory torch held at once during fn, over what it held before (the profiler's
    allocation records, in order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    held = peak = 0
    for e in records:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("loss", ["info_nce", "info_nce_hard_neg_weighted", "arccon", "nt_xent"])
def test_the_chunked_losses_peak_memory_stays_linear_in_n(loss):
    """Forward and backward of each whole loss (normalisation, hard negatives, metrics included) on the chunked path
    hold O(N*D + N*C) bytes at their peak; the eager path's N x M matrix is the yardstick the probe must see."""
    n, d, c = 2048, 16, 32
    gen = torch.Generator().manual_seed(0)
    q, k, neg = (torch.randn(n, d, generator=gen).requires_grad_() for _ in range(3))
    pos = torch.arange(n)

    def run(impl):
        kw = dict(impl=impl, chunk_size=c)
        if loss == "nt_xent":
            out = nt_xent(q, k, temperature=0.1, **kw)[0]
        elif loss == "arccon":
            out = info_nce(q, k, pos, temperature=0.05, margin=math.radians(10.0), **kw)[0]
        else:
            weight = 2.0 if loss.endswith("weighted") else 1.0
            out = info_nce(q, k, pos, temperature=0.05, neg_MD=neg if "hard" in loss else None, neg_weight=weight,
                           **kw)[0]
        out.backward()

    rows = 2 * n if loss == "nt_xent" else n
    full = rows * rows * 4
    assert _peak_bytes(lambda: run("eager")) >= full  # the probe sees N x M buffers when they exist
    bound = 16 * rows * d * 4 + 4 * rows * c * 4  # measured: ~8 N x D copies (inputs, normalised, grads)
    assert bound < full // 2
    assert _peak_bytes(lambda: run("torch")) <= bound


def test_bf16_views_give_the_float32_loss_of_their_rounded_values():
    """bf16 embeddings: the loss is computed in float32 from the (normalised) bf16 values, so it equals the float32
    loss of the same values, not a bf16-accumulated one (which is ~1e-2 off at tau = 0.05)."""
    gen = torch.Generator().manual_seed(5)
    z_a, z_b = (F.normalize(torch.randn(64, 32, generator=gen), dim=-1).bfloat16() for _ in range(2))
    for impl in ("torch", "eager"):
        got, _, _ = nt_xent(z_a, z_b, temperature=0.05, impl=impl, chunk_size=16)
        z = F.normalize(torch.cat([z_a, z_b]).double(), dim=-1).bfloat16().double()
        s = z @ z.T / 0.05
        s.fill_diagonal_(float("-inf"))
        partner = (torch.arange(128) + 64) % 128
        want = -(s.log_softmax(-1)[torch.arange(128), partner]).sum()
        assert float(got) == pytest.approx(float(want), rel=2e-5)
