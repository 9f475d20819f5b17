"""The whole-step reference for objective.gradient_cache's tests (tests/unit/test_grad_cache.py,
tests/distributed/test_grad_cache_ranks.py): tiny objectives by paper, a step's rows split into chunks, the
cached-gradient pass as training/cached_step.py runs it (without DeepSpeed), and the whole step's gradient with every
chunk's graph held.

The reference encodes each chunk under the RNG key the cached pass uses for it (``chunk_rng``: seed, step, rank,
chunk), concatenates the embeddings in rank order (the gathered order), runs the terms that compare sentences on the
concatenation and normalises the per-sample terms by the step's count; one backward. In float64 it draws the float32
run's dropout masks only with ``dtype_free_dropout`` patched in (torch draws a float64 tensor's mask from other
random numbers than a float32's).
Legend: S sentences in the step, chunks of B rows, T tokens.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import torch

from pretrain.config.model import ModelConfig
from pretrain.config.objective import (
    ArcConConfig,
    ConsistencyConfig,
    InfoNCEConfig,
    MatryoshkaConfig,
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
from pretrain.objective.matryoshka import run_term
from pretrain.training.cached_step import chunk_rng

VOCAB, CLS, SEP, MASK = 50, 2, 3, 4
ONE = SimpleNamespace(rank=0, world_size=1, is_distributed=False)
SEED, STEP = 11, 3

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



def dtype_free_dropout(x, p=0.5, training=True, inplace=False):
    """F.dropout drawing its keep-mask in float32 whatever the input's dtype (tests patch it in for both runs)."""
    if not training or p == 0.0:
        return x
    keep = torch.empty(x.shape, dtype=torch.float32, device=x.device).bernoulli_(1.0 - p)
    return x * keep.to(x.dtype) / (1.0 - p)


def tiny_model(seed: int, dropout: float = 0.1):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_position=64,
                      dropout=dropout, attention_dropout=0.0, pooling="cls", projection_layers=2)
    return build_model(cfg, seed=seed)


def random_rows(num: int, seed: int, t: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    ids = torch.zeros(num, t, dtype=torch.long)
    mask = torch.zeros(num, t, dtype=torch.bool)
    for b, n in enumerate(rng.integers(3, t - 2, size=num)):
        ids[b, : n + 2] = torch.tensor([CLS, *rng.integers(6, VOCAB, size=n), SEP])
        mask[b, : n + 2] = True
    return ids, mask


def step_batch(stage: str, num: int, seed: int = 0) -> dict:
    """A whole step's rows (S of them), split into chunks by ``split_chunks``."""
    ids, mask = random_rows(num, seed)
    g = torch.Generator().manual_seed(seed)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.25) & mask & (ids > SEP), ids, -100)
    batch = {"input_ids": ids.masked_fill(labels != -100, MASK), "attention_mask": mask, "mlm_labels": labels}
    if stage == "pretrain":
        (va, vam), (vb, vbm) = random_rows(num, seed + 1, t=10), random_rows(num, seed + 2, t=9)  # views of other lengths
        batch.update(view_a_ids=va, view_a_mask=vam, view_b_ids=vb, view_b_mask=vbm)
    else:
        batch.update(sentence_ids=ids, sentence_mask=mask)
        if stage == "pairs":  # data.pairs: each anchor's positive and hard negative, of other lengths
            (pi, pm), (ni, nm) = random_rows(num, seed + 3, t=10), random_rows(num, seed + 4, t=11)
            batch.update(positive_ids=pi, positive_mask=pm, negative_ids=ni, negative_mask=nm)
        low, high = ids.clone(), ids.clone()
        low[:, 1:3], high[:, 1:5] = MASK, MASK
        batch.update(triplet_anchor_ids=ids, triplet_anchor_mask=mask, triplet_low_ids=low * mask,
                     triplet_low_mask=mask, triplet_high_ids=high * mask, triplet_high_mask=mask)
    return batch


def split_chunks(batch: dict, sizes: list[int]) -> list[dict]:
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
    "simcse_sup": ("pairs", {"mlm": None, "nt_xent": None, "info_nce": InfoNCEConfig(hard_negative_weight=2.0),
                             "arccon": ArcConConfig(weight=0.5), "consistency": ConsistencyConfig(weight=0.3)}),
    "simcse_sup_matryoshka": ("pairs", {"mlm": None, "nt_xent": None, "info_nce": InfoNCEConfig(),
                                        "consistency": ConsistencyConfig(weight=0.3),
                                        "matryoshka": MatryoshkaConfig(dims=[16, 4], weights=[1.0, 0.5])}),
}
"""Objectives by paper: the terms and the data stage (which batch keys hold the pair; ``pairs``: the sentence stage
on data.pairs, (anchor, positive) and a hard negative)."""


def case_module(case: str, *, env=ONE, dropout: float = 0.1, similarity: str = "torch") -> TrainModule:
    """CASES[case] with objective.gradient_cache on a tiny model (the same weights for every call), training mode."""
    stage, terms = CASES[case]
    cfg = ObjectiveConfig(**terms, gradient_cache=True)
    ctx = Context(env=env, ops=OpsConfig(similarity=similarity, chunk_size=3), pooling="mean",
                  stage="sentences" if stage == "pairs" else stage)
    teachers = Teachers(cfg.rank_distill, models=[tiny_model(7, dropout=0.0)]) if cfg.rank_distill else None
    freq = None
    if cfg.reconstruction is not None:
        freq = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        freq = freq / freq.sum()
    return TrainModule(tiny_model(1, dropout), Objective(cfg, ctx, teachers=teachers, token_freq_V=freq)).train()


def to_double(module: TrainModule) -> TrainModule:
    """The same module in float64 on one process, with the eager (materialised) similarity op and float64
    teachers."""
    ref = copy.deepcopy(module).double()
    obj = ref.objective
    obj.ctx = Context(env=ONE, ops=OpsConfig(similarity="eager"), pooling="mean", stage=obj.ctx.stage,
                      matryoshka_dims=obj.ctx.matryoshka_dims)
    if obj.teachers is not None:
        obj.teachers = Teachers(obj.teachers.cfg, models=[copy.deepcopy(m).double() for m in obj.teachers.models])
    return ref


def as_double(chunk: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in chunk.items()}


def gathered_weights(module) -> dict:
    """Every parameter whole, as float64 copies by name (ZeRO-3's partitions gathered first; collective there)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {n: p.detach().double().clone() for n, p in module.named_parameters()}


def param_grads(module) -> dict:
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
    return param_grads(module), total


def reference_grads(module: TrainModule, chunks: list[dict], keys: list[tuple[int, int]] | None = None, *,
                    zero: bool = True) -> tuple[dict, float]:
    """The whole step's loss with every chunk's graph held, one backward (plain autograd, no cache). Chunk i draws
    its dropout under the RNG key of (rank, chunk) ``keys[i]`` (default: (0, i)); all ranks' chunks in rank order."""
    if zero:
        module.zero_grad(set_to_none=True)
    obj = module.objective
    stage = obj.ctx.stage
    names = [n for n, _, _ in obj.terms]
    pair_is_views = stage == "pretrain" and "reconstruction" not in names
    parts = {"views": [], "pair": [], "negative": [], "teacher": []}
    sample = {n: [] for n in names if n not in CONTRASTIVE}
    for (rank, k), chunk in zip(keys or [(0, i) for i in range(len(chunks))], chunks):
        with chunk_rng(SEED, STEP, rank, k, "cpu"):
            fwd = Forward(module.model, chunk, obj.ctx, heads=module.heads, teachers=obj.teachers,
                          token_freq_V=obj.token_freq_V)
            # The embeddings first (the order that decides the dropout masks), then the per-sample terms.
            if "nt_xent" in names or pair_is_views:
                parts["views"].append(fwd.view_projections())
            if not pair_is_views:
                parts["pair"].append(fwd.pair())
            if "negative_ids" in chunk:
                parts["negative"].append(fwd.hard_negatives())
            if obj.teachers is not None:
                parts["teacher"].append(fwd.teacher_embeddings()[0])
            for name, fn, cfg in obj.terms:
                if name in sample:
                    loss_sum, count, _ = fn(fwd, cfg, obj.ctx)
                    sample[name].append((loss_sum, count))
    cached = {key: tuple(torch.cat([p[i] for p in v]) for i in (0, 1)) for key, v in parts.items()
              if v and key != "negative"}
    if parts["negative"]:
        cached["negative"] = torch.cat(parts["negative"])
    if "teacher" in cached:
        cached["teacher"] = [cached["teacher"]]
    step = Forward(None, {}, obj.ctx, heads={}, teachers=obj.teachers, cached=cached)
    loss = 0.0
    for name, fn, cfg in obj.terms:
        weight = 1.0 if name == "reconstruction" else cfg.weight
        if name in CONTRASTIVE:  # at each objective.matryoshka size when set (objective/matryoshka.py)
            loss_sum, count, _ = run_term(name, fn, step, cfg, obj.ctx, obj.sizes)
        else:
            loss_sum, count = sum(s for s, _ in sample[name]), sum(c for _, c in sample[name])
        loss = loss + weight * loss_sum / count
    loss.backward()
    return param_grads(module), float(loss.detach())


def mismatch(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys()
    floor = GRAD_ATOL * max(float(g.abs().max()) for g in want.values())
    bad = []
    for name, g in want.items():
        err = float((got[name] - g).abs().max())
        bound = GRAD_RTOL * float(g.abs().max()) + floor
        if err > bound:
            bad.append(f"{name}: {err:.3g} > {bound:.3g}")
    return bad


