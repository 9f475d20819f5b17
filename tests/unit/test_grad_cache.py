"""objective.gradient_cache on one process: the cached-gradient pass gives the parameters the whole step's gradient.

The reference holds every chunk's graph at once and back-propagates the whole step's loss in float64: each chunk is
encoded under the same RNG key as in the cached pass (``chunk_rng``), its embeddings are concatenated, the terms
that compare sentences run on the concatenation and the per-sample terms are normalised by the step's count. The
cached pass runs in float32, with the chunked similarity op. Dropout is on; its masks are drawn in float32 for
both (``dtype_free_dropout``: torch draws a float64 tensor's mask from other random numbers than a float32's).
Legend: S sentences in the step, chunks of B rows, T tokens.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pretrain.config.model import ModelConfig
from pretrain.config.objective import (
    ArcConConfig,
    ConsistencyConfig,
    InfoNCEConfig,
    MLMConfig,
    NTXentConfig,
    ObjectiveConfig,
    RankDistillConfig,
    ReconstructionConfig,
    TripletConfig,
)
from pretrain.config.train import OpsConfig
from pretrain.model import build_model
from pretrain.objective import Context, Forward, Objective, Teachers, TrainModule
from pretrain.objective.grad_cache import CONTRASTIVE, contrast
from pretrain.training.cached_step import chunk_rng

VOCAB, CLS, SEP, MASK = 50, 2, 3, 4
ENV = SimpleNamespace(rank=0, world_size=1, is_distributed=False)
SEED, STEP = 11, 3

pytestmark = pytest.mark.usefixtures("one_thread", "dtype_free_dropout")

GRAD_RTOL = 1e-4
"""How far the float32 cached gradient may lie from the float64 whole-step gradient, relative to the largest element
of its tensor. A gradient element here is a sum over the step's ~S*T positions of products through two layers
forward and back, each rounded at eps32 = 6e-8; with cancellation the float32 result moves by ~sqrt(n) * eps32 *
sum|terms|, a few 1e-6 of the tensor's largest element (measured: at most 3.9e-6 over these cases). 1e-4 is 25x
that. What the cache is for, negatives limited to a chunk, moves gradients by ~3e-1 of it (asserted below), and a
chunk replayed under another RNG key (other dropout masks) by ~3 (its cached gradient then meets other embeddings)."""

GRAD_ATOL = 1e-6
"""...of the largest gradient element of the whole model: a floor for tensors whose exact gradient is ~0 (attention
key biases, to which softmax is blind: their float32 'gradients' are rounding noise)."""


@pytest.fixture
def dtype_free_dropout(monkeypatch):
    """F.dropout drawing its keep-mask in float32 whatever the input's dtype, so that the float64 reference draws
    the float32 run's masks from the same RNG state."""

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        keep = torch.empty(x.shape, dtype=torch.float32, device=x.device).bernoulli_(1.0 - p)
        return x * keep.to(x.dtype) / (1.0 - p)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)


def _model(seed: int, dropout: float = 0.1):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_position=64,
                      dropout=dropout, attention_dropout=0.0, pooling="cls", projection_layers=2)
    return build_model(cfg, seed=seed)


def _rows(num: int, seed: int, t: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    ids = torch.zeros(num, t, dtype=torch.long)
    mask = torch.zeros(num, t, dtype=torch.bool)
    for b, n in enumerate(rng.integers(3, t - 2, size=num)):
        ids[b, : n + 2] = torch.tensor([CLS, *rng.integers(6, VOCAB, size=n), SEP])
        mask[b, : n + 2] = True
    return ids, mask


def _step_batch(stage: str, num: int, seed: int = 0) -> dict:
    """A whole step's rows (S of them), split into chunks by ``_chunks``."""
    ids, mask = _rows(num, seed)
    g = torch.Generator().manual_seed(seed)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.25) & mask & (ids > SEP), ids, -100)
    batch = {"input_ids": ids.masked_fill(labels != -100, MASK), "attention_mask": mask, "mlm_labels": labels}
    if stage == "pretrain":
        (va, vam), (vb, vbm) = _rows(num, seed + 1, t=10), _rows(num, seed + 2, t=9)  # views of other lengths
        batch.update(view_a_ids=va, view_a_mask=vam, view_b_ids=vb, view_b_mask=vbm)
    else:
        batch.update(sentence_ids=ids, sentence_mask=mask)
        low, high = ids.clone(), ids.clone()
        low[:, 1:3], high[:, 1:5] = MASK, MASK
        batch.update(triplet_anchor_ids=ids, triplet_anchor_mask=mask, triplet_low_ids=low * mask,
                     triplet_low_mask=mask, triplet_high_ids=high * mask, triplet_high_mask=mask)
    return batch


def _chunks(batch: dict, sizes: list[int]) -> list[dict]:
    out, lo = [], 0
    for n in sizes:
        chunk = {k: v[lo:lo + n] for k, v in batch.items()}
        if "triplet_anchor_ids" in chunk:  # every other sentence of the chunk has a triplet
            rows = torch.arange(0, n, 2)
            chunk.update({k: v[rows] for k, v in chunk.items() if k.startswith("triplet_")},
                         triplet_index=rows)
        out.append(chunk)
        lo += n
    return out


CASES = {
    "clear": ("pretrain", {"mlm": MLMConfig(), "nt_xent": NTXentConfig(temperature=0.1),
                           "info_nce": InfoNCEConfig(weight=0.5)}),
    "simcse_arccse": ("sentences", {"mlm": None, "nt_xent": None, "info_nce": InfoNCEConfig(weight=0.7),
                                    "arccon": ArcConConfig(weight=0.5), "consistency": ConsistencyConfig(weight=0.3),
                                    "triplet": TripletConfig(weight=0.2, margin=0.5)}),
    "rankcse": ("sentences", {"mlm": MLMConfig(weight=0.1), "nt_xent": None, "info_nce": InfoNCEConfig(),
                              "rank_distill": RankDistillConfig(teachers=["t"], teacher_pooling="mean",
                                                                student_temperature=0.05)}),
    "sarcse": ("sentences", {"mlm": None, "nt_xent": None, "info_nce": InfoNCEConfig(),
                             "reconstruction": ReconstructionConfig(weight=0.3, positive_weight=0.6, lam=5.0,
                                                                    channels=6, integrate_channels=2)}),
}
"""Objectives by paper: the terms and the data stage (which batch keys hold the pair)."""


def _module(case: str, *, similarity: str = "torch") -> TrainModule:
    stage, terms = CASES[case]
    cfg = ObjectiveConfig(**terms, gradient_cache=True)
    ctx = Context(env=ENV, ops=OpsConfig(similarity=similarity, chunk_size=3), pooling="mean", stage=stage)
    teachers = Teachers(cfg.rank_distill, models=[_model(7, dropout=0.0)]) if cfg.rank_distill else None
    freq = None
    if cfg.reconstruction is not None:
        freq = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        freq = freq / freq.sum()
    return TrainModule(_model(1), Objective(cfg, ctx, teachers=teachers, token_freq_V=freq)).train()


def _double(module: TrainModule) -> TrainModule:
    """The same module in float64, with the eager (materialised) similarity op and float64 teachers."""
    ref = copy.deepcopy(module).double()
    obj = ref.objective
    obj.ctx = Context(env=ENV, ops=OpsConfig(similarity="eager"), pooling="mean", stage=obj.ctx.stage)
    if obj.teachers is not None:
        obj.teachers = Teachers(obj.teachers.cfg, models=[copy.deepcopy(m).double() for m in obj.teachers.models])
    return ref


def _grads(module) -> dict:
    return {n: p.grad.detach().double().clone() for n, p in module.named_parameters() if p.grad is not None}


def cached_grads(module: TrainModule, chunks: list[dict]) -> tuple[dict, float]:
    """The cached-gradient pass as training/cached_step.py runs it (without DeepSpeed) -> (gradients, step loss)."""
    module.zero_grad(set_to_none=True)
    embedded = []
    with torch.no_grad():
        for k, chunk in enumerate(chunks):
            with chunk_rng(SEED, STEP, 0, k, "cpu"):
                embedded.append(module(chunk, embed_only=True))
    cache = contrast(module.objective, embedded)
    total = float(cache.loss)
    for k, chunk in enumerate(chunks):
        with chunk_rng(SEED, STEP, 0, k, "cpu"):
            loss, value, _ = module(chunk, cached=cache.chunks[k])
        loss.backward()
        total += float(value)
    return _grads(module), total


def reference_grads(module: TrainModule, chunks: list[dict], keys: list[int] | None = None, *,
                    zero: bool = True) -> tuple[dict, float]:
    """The whole step's loss with every chunk's graph held, one backward (plain autograd, no cache). Chunk i draws
    its dropout under RNG key ``keys[i]`` (default: i)."""
    if zero:
        module.zero_grad(set_to_none=True)
    obj = module.objective
    stage = obj.ctx.stage
    names = [n for n, _, _ in obj.terms]
    pair_is_views = stage == "pretrain" and "reconstruction" not in names
    parts = {"views": [], "pair": [], "teacher": []}
    sample = {n: [] for n in names if n not in CONTRASTIVE}
    for k, chunk in zip(keys or range(len(chunks)), chunks):
        with chunk_rng(SEED, STEP, 0, k, "cpu"):
            fwd = Forward(module.model, chunk, obj.ctx, heads=module.heads, teachers=obj.teachers,
                          token_freq_V=obj.token_freq_V)
            # The embeddings first (the order that decides the dropout masks), then the per-sample terms.
            if "nt_xent" in names or pair_is_views:
                parts["views"].append(fwd.view_projections())
            if not pair_is_views:
                parts["pair"].append(fwd.pair())
            if obj.teachers is not None:
                parts["teacher"].append(fwd.teacher_embeddings()[0])
            for name, fn, cfg in obj.terms:
                if name in sample:
                    loss_sum, count, _ = fn(fwd, cfg, obj.ctx)
                    sample[name].append((loss_sum, count))
    cached = {key: tuple(torch.cat([p[i] for p in v]) for i in (0, 1)) for key, v in parts.items() if v}
    if "teacher" in cached:
        cached["teacher"] = [cached["teacher"]]
    step = Forward(None, {}, obj.ctx, heads={}, teachers=obj.teachers, cached=cached)
    loss = 0.0
    for name, fn, cfg in obj.terms:
        weight = 1.0 if name == "reconstruction" else cfg.weight
        if name in CONTRASTIVE:
            loss_sum, count, _ = fn(step, cfg, obj.ctx)
        else:
            loss_sum, count = sum(s for s, _ in sample[name]), sum(c for _, c in sample[name])
        loss = loss + weight * loss_sum / count
    loss.backward()
    return _grads(module), float(loss.detach())


def _mismatch(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys()
    floor = GRAD_ATOL * max(float(g.abs().max()) for g in want.values())
    bad = []
    for name, g in want.items():
        err = float((got[name] - g).abs().max())
        bound = GRAD_RTOL * float(g.abs().max()) + floor
        if err > bound:
            bad.append(f"{name}: {err:.3g} > {bound:.3g}")
    return bad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sizes", [[5, 5], [4, 4, 2], [3, 1, 6]], ids=["5+5", "4+4+2", "3+1+6"])
def test_cached_gradient_equals_the_whole_step_gradient(case, sizes):
    module = _module(case)
    chunks = _chunks(_step_batch(CASES[case][0], sum(sizes)), sizes)
    got, got_loss = cached_grads(module, chunks)
    want, want_loss = reference_grads(_double(module), [_as_double(c) for c in chunks])
    assert len(got) > 10 and all(float(g.abs().max()) > 0 for g in list(want.values())[:3])
    assert _mismatch(got, want) == []
    assert got_loss == pytest.approx(want_loss, rel=1e-5)


def _as_double(chunk: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in chunk.items()}


def test_negatives_limited_to_a_chunk_give_another_gradient():
    """The bug the cache is for: uncached, each micro-step's terms see only its own micro-batch (gradients averaged
    over micro-steps, as DeepSpeed accumulates them), here with the same dropout masks as the whole step's."""
    module = _double(_module("clear"))
    chunks = [_as_double(c) for c in _chunks(_step_batch("pretrain", 10), [5, 5])]
    want, _ = reference_grads(module, chunks)
    module.zero_grad(set_to_none=True)
    for k, chunk in enumerate(chunks):
        reference_grads(module, [chunk], [k], zero=False)  # adds this micro-step's gradient
    per_chunk = {n: g / len(chunks) for n, g in _grads(module).items()}
    bad = _mismatch(per_chunk, want)
    assert any(b.startswith("model.projection.") for b in bad), bad


def test_replay_draws_pass_one_dropout_masks_and_misses_without_it():
    """Pass 2 recomputes each chunk's embeddings bit for bit, with attention dropout on too (the real torch dropout:
    no float32 patch needed, one dtype); under another RNG key they differ, and so would the gradient."""
    module = _module("clear")
    module.model.cfg.attention_dropout = 0.1
    for m in module.model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    chunk = _chunks(_step_batch("pretrain", 6), [6])[0]
    with torch.no_grad(), chunk_rng(SEED, STEP, 0, 0, "cpu"):
        first = module(chunk, embed_only=True)["views"]
    with chunk_rng(SEED, STEP, 0, 0, "cpu"):
        again = module.objective.forward_cache(module.model, chunk, module.heads).view_projections()
    with chunk_rng(SEED, STEP, 0, 1, "cpu"):
        other = module.objective.forward_cache(module.model, chunk, module.heads).view_projections()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert again[0].requires_grad
    assert not torch.allclose(first[0], other[0])
