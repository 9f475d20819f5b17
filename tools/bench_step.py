"""Full training step (MLM + CLEAR NT-Xent: forward, backward, optimizer) — ours vs Hugging Face.

Ours: PretrainModel + Objective through the DeepSpeed Engine, the trainer's own step
(``pretrain.training.step.optimizer_step``: dropout keyed by step, finite check, metrics; MLM head on masked rows
only, SDPA, fused/chunked NT-Xent). HF: ``transformers.BertForMaskedLM``
(SDPA attention, full-sequence MLM head, as ``labels=`` computes it) plus the same CLEAR loss written
the usual way (projection MLP, 2N x 2N similarity, cross-entropy), with ``torch.optim.AdamW`` (fused, as
the Engine's); in bf16 HF runs under ``torch.autocast`` (fp32 weights), the usual way to train it in bf16.
Same sizes, same synthetic batch, one process per (size, batch), alternating trials.

MFU counts the model FLOPs of the timed batches per sample (``batch_flops_per_sample``: 3 x the forward matmuls,
i.e. forward + backward; attention scores included; over the rows' real lengths, so padding counts nothing; the
MLM head on the labelled tokens only and, as ``train.trim_last_layer`` computes it, the last layer only where a
loss reads it) over the median step time (the batch is ready: no data wait), against the device's dense bf16 peak
(``--peak-tflops``, default 989 = H100 SXM and H200; not the sparse 1979) and against a measured 8192^3 matmul.
Both arms are counted with the same FLOPs a sample (HF's extra work, its full last layer and BERT's MLM head at
every position, is not credited), so ours / HF in MFU is ours / HF in samples/s. Samples/s: the micro-batch over
the median step time, one process (one device); the same for both arms. Before 2026-12-07 MFU counted the last
layer in full and the full ``--seq`` / ``--view-len`` even on ``--data`` batches (docs/performance.md's
corrections).

    python tools/bench_step.py --sizes tiny mini --seq 128 --batch 32 --steps 10          # CPU
    python tools/bench_step.py --device cuda --precision bf16 --sizes base --batch 64 128 256 512

``--arch modernbert`` (issue 27): ours with model.arch=modernbert at configs/models/modernbert-{size}.yaml's shapes,
HF's ``transformers.ModernBertForMaskedLM`` built from the same ModelConfig (pretrain/export/hf_modern.py's
config mapping: hidden, layers, heads, GeGLU width, local window, global every N, rope bases, no biases), dropout
at ours' rates, HF's own ``sparse_prediction`` (its MLM head on the masked rows only, as ModernBERT trains), the
same CLEAR loss, optimizer, precision and batch. transformers 5.x's ModernBERT has no unpadding code of its own:
every attention implementation gets (B, T, D) states and a padding / sliding-window mask; only
flash_attention_2 (CUDA, the flash-attn package) unpads, inside the attention call. So HF runs SDPA (padded) on the
CPU, and flash_attention_2 on CUDA when flash-attn is installed. The synthetic batch has no padding, so padded and
unpadded paths do the same arithmetic here.

    python tools/bench_step.py --arch modernbert --sizes tiny mini --steps 10                # CPU

``--data books|wiki`` (CPU): instead of the synthetic full-length batch, the micro-batches the trainer gets from
the shared corpus (CLEAR's recipe: its masking and views, padded to each batch's longest row as collate pads them),
a new one each step, the same sequence for both arms; the padding shares of the timed batches are printed.

``--host-cost`` (CPU): the host's cost of a step. BERT-base depth (12 layers) at a width, length and batch so small
that arithmetic is negligible (``HOST_COST``), one thread, so wall time is host time; ZeRO 0 and 2 x fp32 and bf16,
one process each, ours and HF alternating in it. Per arm: median host ms per step, and over one step after
warm-up the aten ops dispatched and those that would force a host-device sync on CUDA (``metrics.op_count``).

    python tools/bench_step.py --host-cost --steps 50 --json-out host_cost.json

The arms share one process, so they share glibc's heap: ``--heap trainer`` (the default) sets it as the trainer
does (``train.malloc_mmap_threshold_kib``: every activation from the heap, none re-mapped each step), ``--heap
glibc`` leaves glibc's own (which re-maps every tensor over 32 MiB each step, and costs HF's padded step more than
ours). ``--matmul-bound`` (CPU) profiles one more step of each arm and prints the seconds each spends in matmuls and
the ratio ours would reach if it did nothing else: how much of a ratio goal the arithmetic alone allows.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pretrain, not an installed one
from pretrain.config import TrainConfig
from pretrain.metrics.op_count import OpCounter

SIZES = {  # configs/models/*.yaml
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, ffn_size=512),
    "mini": dict(hidden_size=256, num_layers=4, num_heads=4, ffn_size=1024),
    "small": dict(hidden_size=512, num_layers=4, num_heads=8, ffn_size=2048),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072),
    "host": dict(hidden_size=32, num_layers=12, num_heads=2, ffn_size=64),  # --host-cost: base's depth, no width
}
MODERN_SIZES = ("tiny", "mini", "base", "large")
"""--arch modernbert: the sizes with a configs/models/modernbert-{size}.yaml."""
ARCHS = ("bert", "modernbert")
MASK_FRAC = 0.15
HOST_COST = {"size": "host", "seq": 16, "view_len": 8, "batch": 4, "vocab": 128}
"""--host-cost's step: SIZES["host"] (12 layers of width 32) on 4 sequences of 16 tokens + views of 8."""
HOST_AB = {"joint": ("ours_two_passes", {"joint": False},
                     "train.joint_pass=false (the MLM rows and the views in two passes)"),
           "layer": ("ours_layer", {"scope": "layer"}, "train.flat_scope=layer (a pair of flat tensors a layer)"),
           "prepare": ("ours_step_packs", {"loader_facts": False},
                       "the batch packed inside the step (before 2026-12-06), not by the loader's workers")}
"""--host-cost --ab: the third arm's name, its build_ours options and what it is."""
HOST_COST_GOAL = "ours <= 0.5x HF's host ms per step and no more aten ops than HF, at ZeRO-2 bf16 (issue 24)"


def model_shape(size: str, arch: str = "bert") -> dict:
    """ModelConfig keys of a size: SIZES[size] for bert; configs/models/modernbert-{size}.yaml's model block (arch,
    shapes, window, rope bases, pooler off) for modernbert."""
    if arch == "bert":
        return dict(SIZES[size])
    if arch != "modernbert":
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    path = Path(__file__).resolve().parents[1] / "configs" / "models" / f"modernbert-{size}.yaml"
    if not path.is_file():
        raise ValueError(f"--arch modernbert has no size {size!r} (no {path}); sizes: {', '.join(MODERN_SIZES)}")
    import yaml

    return yaml.safe_load(path.read_text())["model"]


def attended_keys(t: int, i: int, shape: dict, arch: str) -> int:
    """Keys all queries of a length-t sequence read in layer i, summed: t^2, or for a modernbert local layer the
    band of queries' own window (at most local_window // 2 positions either side, clipped at the ends)."""
    if arch != "modernbert" or i % shape["global_every"] == 0:
        return t * t
    h = shape["local_window"] // 2
    return sum(min(t - 1, q + h) - max(0, q - h) + 1 for q in range(t))


def encoder_flops(t: int, kept: int | None, shape: dict, arch: str) -> float:
    """Forward matmul FLOPs of one length-t sequence through the encoder. Per layer and token 8 d^2 (q, k, v, out) +
    the FFN, 4 d f (bert: d -> f -> d) or 6 d f (modernbert's GeGLU: d -> 2f, f -> d); per layer 4 d x the keys its
    queries read (scores and weighted values: 4 t^2 d, a local layer its band). ``kept``: the last layer computed
    for that many rows only (train.trim_last_layer: k, v at every token; q, attention, out and FFN at the kept
    rows), None for all."""
    d, layers, f = shape["hidden_size"], shape["num_layers"], shape["ffn_size"]
    proj_ffn = 8 * d * d + (6 if arch == "modernbert" else 4) * d * f
    total = 0.0
    for i in range(layers):
        keys = attended_keys(t, i, shape, arch)
        if kept is None or i < layers - 1:
            total += t * proj_ffn + 4 * keys * d
        else:  # the kept rows' share of the attention: their mean keys
            total += t * 4 * d * d + kept * (proj_ffn - 4 * d * d) + 4 * kept * (keys / t if t else 0) * d
    return total


def batch_train_flops(mlm_rows: list[tuple[int, int]], views: list[int], shape: dict, arch: str, vocab: int,
                      pooling: str = "mean", trim: bool = True) -> float:
    """Model FLOPs of a step: 3 x the forward matmul FLOPs (backward twice the forward; recomputation not counted)
    that the losses need, over real (unpadded) lengths. ``mlm_rows``: (real length, labelled tokens) of each MLM
    row; ``views``: every view's real length. The MLM head, 2 d^2 (transform) + 2 d V (decoder), runs on the
    labelled tokens only; with ``trim`` (train.trim_last_layer, ours' default) the last layer only where a loss
    reads it: the labelled tokens of an MLM row, one [CLS] row a view under [CLS] pooling (every view token
    under mean pooling). Embeddings (lookups), norms, pooling, the projection and the similarity matrix are left
    out (< 0.1% at BERT-base, tests/unit/test_flops_accounting.py). The same count for both arms: HF computes
    more (its full last layer; BERT's MLM head at every position; padding), which its MFU does not credit."""
    d = shape["hidden_size"]
    fwd = 0.0
    for t, labelled in mlm_rows:
        fwd += encoder_flops(t, labelled if trim else None, shape, arch) + labelled * (2 * d * d + 2 * d * vocab)
    for t in views:
        fwd += encoder_flops(t, 1 if trim and pooling == "cls" else None, shape, arch)
    return 3.0 * fwd


def batch_flops_per_sample(batch: dict, shape: dict, arch: str, vocab: int, pooling: str = "mean",
                           trim: bool = True) -> float:
    """``batch_train_flops`` of a host batch (its masks and MLM labels: real lengths, labelled tokens) per sample."""
    rows = list(zip(batch["attention_mask"].sum(1).tolist(), (batch["mlm_labels"] != -100).sum(1).tolist()))
    views = batch["view_a_mask"].sum(1).tolist() + batch["view_b_mask"].sum(1).tolist()
    return batch_train_flops(rows, views, shape, arch, vocab, pooling, trim) / len(rows)


def train_flops_per_sample(size: str, seq: int, view_len: int, vocab: int, mask_frac: float = MASK_FRAC,
                           arch: str = "bert", pooling: str = "mean", trim: bool = True) -> float:
    """``batch_train_flops`` of one sample at full length: a sequence of ``seq`` with ``mask_frac`` of its tokens
    labelled and two views of ``view_len``. MFU (the table) uses the timed batches' own count
    (``batch_flops_per_sample``); this is the estimate for a shape."""
    return batch_train_flops([(seq, mask_frac * seq)], [view_len, view_len], model_shape(size, arch), arch, vocab,
                             pooling, trim)


def make_batch(batch: int, seq: int, view_len: int, vocab: int, gen: torch.Generator) -> dict:
    ids = torch.randint(6, vocab, (batch, seq), generator=gen)
    ids[:, 0], ids[:, -1] = 2, 3
    labels = torch.full_like(ids, -100)
    sel = torch.rand(batch, seq, generator=gen) < 0.15
    sel[:, 0] = sel[:, -1] = False
    labels[sel] = ids[sel]
    inp = ids.clone()
    inp[sel] = 4
    mask = torch.ones(batch, seq, dtype=torch.bool)
    va = torch.randint(6, vocab, (batch, view_len), generator=gen)
    vb = torch.randint(6, vocab, (batch, view_len), generator=gen)
    vmask = torch.ones(batch, view_len, dtype=torch.bool)
    return dict(input_ids=inp, attention_mask=mask, mlm_labels=labels, view_a_ids=va, view_a_mask=vmask,
                view_b_ids=vb, view_b_mask=vmask)


DATA_SOURCES = ("books", "wiki")


def real_batches(source: str, batch: int, seq: int, view_len: int, count: int,
                 work: str = "") -> list[dict]:
    """``count`` micro-batches the trainer would get from the shared corpus ``source`` (books or the first 20 MB of
    the wiki), CLEAR's recipe (configs/recipes/clear_del_span_reorder.yaml: its masking and views) at ``seq`` /
    ``view_len``, BERT's 30522 WordPiece: padded to each batch's longest row, as collate pads them. Datasets and
    loader are ``tools/padding_share.py``'s (preprocessed once into ``work``, default its DEFAULT_WORK)."""
    import padding_share

    tok_path = padding_share.bert_tokenizer()
    path = padding_share.prepare(Path(work or padding_share.DEFAULT_WORK), tok_path, 20, (source,))[source]
    recipe = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "clear_del_span_reorder.yaml"
    it = padding_share.recipe_batches(str(recipe), tok_path, [(source, path)], batch, seq, view_len)
    return [dict(next(it)) for _ in range(count)]


def padding_shares(batches: list[dict]) -> dict[str, float]:
    """Share of padding in the MLM rows and in the views of ``batches`` (tokens at each batch's width)."""
    def share(masks):
        return 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)

    return {"mlm": share([b["attention_mask"] for b in batches]),
            "views": share([m for b in batches for m in (b["view_a_mask"], b["view_b_mask"])])}


def build_ours(size: str, vocab: int, seq: int, zero_stage: int, precision: str = "fp32", compile_: bool = False,
               micro_batch: int = 1, flat: bool = True, arch: str = "bert", pooling: str = "mean", trim: bool = True,
               fast_dropout: bool = True, compile_mode: str = "default", pin: bool = True, joint: bool = True,
               attention: str = "auto", unpadded: bool = True, scope: str = "encoder", loader_facts: bool = True):
    """Ours as the trainer builds it; ``step(host_batch)`` is the trainer's step: ``training.step.optimizer_step``
    (grad_accum 1, dropout keyed by step, the finite check, metrics into a MetricSums, the Engine's update;
    ``unpadded``: train.unpadded, ``flat``: train.flat_params, ``trim``: train.trim_last_layer,
    ``fast_dropout``: train.fast_dropout, ``pin``: train.pin_memory, ``joint``: train.joint_pass, all on by
    default; ``attention``: train.unpadded_attention; ``scope``: train.flat_scope; ``loader_facts``: the batch
    packed as the trainer's loader workers pack it, once and outside the step, else inside).
    ``step.num_params``: the trained module's parameters (bert: with BERT's pooler, which BertForMaskedLM
    lacks)."""
    from pretrain.config import (
        DistributedConfig,
        ObjectiveConfig,
        OpsConfig,
        OptimConfig,
        TrainConfig,
    )
    from pretrain.distributed.engine import Engine
    from pretrain.distributed.env import detect_env, init_process_group
    from pretrain.metrics.accumulate import MetricSums
    from pretrain.model import build_model
    from pretrain.model.dropout import set_fast_dropout
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.model.modern import compile_band
    from pretrain.training.build import apply_param_layout, compile_options
    from pretrain.training.optim import build_param_groups, lr_lambda
    from pretrain.training.step import HostFacts, optimizer_step

    env = detect_env()
    init_process_group(env, backend="auto", timeout_s=600)
    model = build_model(ours_model_config(size, vocab, seq, arch, pooling))
    train = TrainConfig(micro_batch_size=micro_batch, precision=precision, compile=compile_, flat_params=flat,
                        trim_last_layer=trim, fast_dropout=fast_dropout, compile_mode=compile_mode, pin_memory=pin,
                        joint_pass=joint, unpadded_attention=attention, unpadded=unpadded, flat_scope=scope)
    ctx = Context(env=env, ops=OpsConfig(), pooling=model.cfg.pooling, trim_last_layer=train.trim_last_layer,
                  joint_pass=train.joint_pass)
    module = TrainModule(model, Objective(ObjectiveConfig(), ctx))
    set_fast_dropout(module, train.fast_dropout)
    num_params = sum(p.numel() for p in module.parameters())  # before flat layers change the tensors
    optim = OptimConfig(lr=1e-4, warmup_steps=0)
    dist = DistributedConfig(zero_stage=zero_stage)
    if compile_:
        compile_band(model, seq)  # as build_train_module: ModernBERT's band-or-dense fixed for the longest row
        module.compile_step(**compile_options(train))
    apply_param_layout(module, train, dist)
    engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim, train=train,
                    dist=dist, env=env, lr_lambda=lr_lambda(optim, 1000))
    engine.train()
    sums, done = MetricSums(), [0]
    unpadded = train.unpadded_layout(arch)
    # The trainer's loader workers pack every batch where they build it (Trainer._step_facts): done here once per
    # batch, outside the timed step, as there.
    facts, prepared = HostFacts(unpadded, module.objective.ctx.joint_pass), {}

    def step(batch):  # the trainer's step (Trainer.train_step), from a host batch as the loader hands it over
        if loader_facts and id(batch) not in prepared:
            prepared[id(batch)] = (batch, facts(batch))  # the batch kept: its id is not reused
        ready = prepared[id(batch)][1] if loader_facts else batch
        result = optimizer_step(engine, lambda: ready, sums, env=env, grad_accum=1, seed=0, step=done[0],
                                precision=precision, unpadded=unpadded,
                                joint=module.objective.ctx.joint_pass, pin_memory=train.pin_memory)
        done[0] += 1
        return result

    step.engine, step.num_params = engine, num_params
    return step


AB_OPTIONS = {"trim": "train.trim_last_layer=false", "dropout": "train.fast_dropout=false",
              "pin": "train.pin_memory=false", "joint": "train.joint_pass=false",
              "varlen": "train.unpadded_attention=varlen", "unpadded": "train.unpadded=false",
              "layer": "train.flat_scope=layer", "prepare": "the batch packed inside the step"}
"""--ab: the option the third arm sets (turns off, but for varlen, which it turns on)."""

POOLINGS = {"mean": "mean", "cls": "cls_before_pooler"}
"""--pooling -> ours' model.pooling: the views' embedding is the mean of their tokens (the quickstart's) or their
[CLS] state as it leaves the encoder (the CLEAR recipes' [CLS], without BERT's pooler, which HF's MLM model lacks)."""


def ours_model_config(size: str, vocab: int, seq: int, arch: str = "bert", pooling: str = "mean"):
    """The ModelConfig both arms are built from: ``model_shape`` at this vocabulary, ``POOLINGS[pooling]``."""
    from pretrain.config import ModelConfig

    shape = model_shape(size, arch)
    if arch == "bert":
        shape["max_position"] = max(512, seq)
    return ModelConfig(vocab_size=vocab, pooling=POOLINGS[pooling], **shape)


def hf_attention(arch: str, device: str) -> str:
    """HF's attention implementation: SDPA, except ModernBERT on CUDA with flash-attn installed (its unpadded
    path: transformers' flash_attention_2 unpads by the padding mask inside the call)."""
    import importlib.util

    if arch == "modernbert" and device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _hf_bert(size: str, vocab: int, seq: int):
    """transformers' BertForMaskedLM at SIZES[size]; (model, encoder) with encoder(ids, mask) -> h_BTD."""
    from transformers import BertConfig, BertForMaskedLM

    s = SIZES[size]
    cfg = BertConfig(vocab_size=vocab, hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                     num_attention_heads=s["num_heads"], intermediate_size=s["ffn_size"],
                     max_position_embeddings=max(512, seq))
    cfg._attn_implementation = "sdpa"
    model = BertForMaskedLM(cfg)
    return model, lambda ids, mask: model.bert(input_ids=ids, attention_mask=mask).last_hidden_state


def _hf_modernbert(size: str, vocab: int, seq: int, device: str):
    """transformers' ModernBertForMaskedLM from ours' ModelConfig (export/hf_modern.py's mapping), dropout at ours'
    rates (embeddings, attention, MLP), sparse_prediction on; (model, encoder) as ``_hf_bert``."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    from pretrain.export.hf_modern import hf_config

    mcfg = ours_model_config(size, vocab, seq, "modernbert")
    d = hf_config(mcfg, {}, "ModernBertForMaskedLM", {})
    d.update(mlp_dropout=mcfg.dropout, sparse_prediction=True, dtype="float32")
    for key in ("architectures", "model_type", "pretrain"):
        d.pop(key)
    cfg = ModernBertConfig(**d)
    cfg._attn_implementation = hf_attention("modernbert", device)
    model = ModernBertForMaskedLM(cfg)
    return model, lambda ids, mask: model.model(input_ids=ids, attention_mask=mask).last_hidden_state


def build_hf(size: str, vocab: int, seq: int, device: str, precision: str = "fp32", compile_: bool = False,
             temperature: float = 0.1, fused: bool = True, arch: str = "bert", pooling: str = "mean",
             compile_mode: str = "default"):
    """HF's step; ``fused``: fused AdamW (the Engine's on CPU and CUDA alike); ``pooling``: the views' masked
    mean, or their first token's state (cls). ``step.num_params``: the model's and the projection's parameters
    (the tied decoder weight once)."""
    model, encoder = _hf_modernbert(size, vocab, seq, device) if arch == "modernbert" else _hf_bert(size, vocab, seq)
    model.to(device)
    if compile_:  # the MLM model and the encoder the views go through (its own module, called directly)
        mode = None if compile_mode == "default" else compile_mode
        model.compile(mode=mode)
        (model.model if arch == "modernbert" else model.bert).compile(mode=mode)
    d = model.config.hidden_size
    proj = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)).to(device)
    params = list(model.parameters()) + list(proj.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
                            fused=fused)
    model.train()
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(batch):
        with autocast:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["mlm_labels"])
            ids = torch.cat([batch["view_a_ids"], batch["view_b_ids"]])
            mask = torch.cat([batch["view_a_mask"], batch["view_b_mask"]])
            h = encoder(ids, mask)
            if pooling == "cls":
                e = h[:, 0]
            else:
                m = mask.unsqueeze(-1).to(h.dtype)
                e = (h * m).sum(1) / m.sum(1)
            z = F.normalize(proj(e).float(), dim=-1)
        n2 = z.shape[0]
        sim = z @ z.T / temperature
        sim.fill_diagonal_(float("-inf"))
        target = (torch.arange(n2, device=sim.device) + n2 // 2) % n2
        loss = out.loss.float() + F.cross_entropy(sim, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    step.num_params = sum(p.numel() for p in params)
    return step


def time_one(step, batch, cuda: bool = False) -> float:
    """Seconds of one step; on CUDA up to the end of its device work (the trainer's step ends without a sync)."""
    t0 = time.perf_counter()
    step(batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def device_busy(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of the window [start, end] in which the device ran something: the union of ``intervals`` (its
    kernels and copies, any unit), clipped to the window, over the window's length. Kernels that overlap (other
    streams) count once. Issue 24's "GPU busy" figure for a profiled stretch of steps."""
    if end <= start:
        return 0.0
    busy, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy / (end - start)


def _profile_busy(prof) -> float:
    """``device_busy`` over a torch.profiler run: CUDA events (kernels, copies, memsets) against the span from
    its first event (a host op) to its last."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    device = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    if not device:
        return float("nan")
    return device_busy(device, min(e.time_range.start for e in events), max(e.time_range.end for e in events))


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls in which the host waits for the device (``sync_sites``)."""
SKIPPED_FRAMES = ("torch/", "pytest/", "pluggy/", "<frozen", "contextlib.py", "threading.py")
"""Python frames ``sync_sites`` leaves out: torch's own, the test runner's, the interpreter's."""


def sync_sites(prof, names=SYNC_EVENTS, frames: int = 4) -> list[tuple[int, str]]:
    """Where the host waited for the device in a torch.profiler run recorded ``with_stack=True``: every event
    named in ``names``, by what enclosed it, innermost first: the ops (``aten::...``), then up to ``frames``
    Python frames ("path(line): function", as the profiler shortens the path) outside ``SKIPPED_FRAMES``.
    [(count, site)], most frequent first. The H200 pass counted 5 ``cudaStreamSynchronize`` a step in ours without
    saying where (docs/performance.md)."""
    sites: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.name not in names:
            continue
        chain, kept, parent = [event.name], 0, event.cpu_parent
        while parent is not None and kept < frames:
            name = parent.name
            if name.startswith("aten::"):
                chain.append(name)
            elif re.search(r"\(\d+\): ", name) and not any(skip in name for skip in SKIPPED_FRAMES):
                chain.append(name)
                kept += 1
            parent = parent.cpu_parent
        sites[" <- ".join(chain)] += 1
    return [(count, site) for site, count in sites.most_common()]


def _timed_arm(name: str, build, batch, steps: int, device: str, profile_out: str = "") -> dict:
    """Build one arm, warm it up (2 steps) and time `steps` steps; {"oom": True} when it does not fit.

    ``profile_out``: afterwards profile 3 more steps back to back and write the kernel table (by device time)
    there; the share of those steps' span in which the GPU ran something is ``busy``."""
    from torch._dynamo.utils import counters

    skips_before = counters["inductor"]["cudagraph_skips"]
    busy = None
    try:
        step = build()
        step(batch), step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = [time_one(step, batch, cuda=device == "cuda") for _ in range(steps)]
        if device == "cuda":  # as the trainer runs: steps back to back, one synchronize after the last
            t0 = time.perf_counter()
            for _ in range(steps):
                step(batch)
            torch.cuda.synchronize()
            run_s = (time.perf_counter() - t0) / steps
        if profile_out:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(batch)
                torch.cuda.synchronize()
            busy = _profile_busy(prof)
            avg = prof.key_averages()
            table = avg.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
            table += "\n-- by self CPU time (where the host spends the step) --\n"
            table += avg.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
            # One more step with Python stacks (their recording slows the host, so not in the busy share above),
            # for where it waited for the device; the synchronize after it is outside the profile.
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                step(batch)
            torch.cuda.synchronize()
            sites = sync_sites(prof)
            syncs = sum(count for count, _ in sites)
            table += f"\n-- where the host waited for the device: one step, {syncs} waits --\n"
            table += "".join(f"{count:5d}  {site}\n" for count, site in sites) or "(none)\n"
            with open(profile_out, "a") as f:
                f.write(f"== {name}: 3 steps, batch {batch['input_ids'].shape[0]}, median step "
                        f"{statistics.median(times):.4f} s, GPU busy {busy:.1%} of the profiled span\n{table}\n")
    except torch.OutOfMemoryError:
        return {"oom": True}
    out = {"s": statistics.median(times), "all_s": times, "num_params": step.num_params}
    if device == "cuda":
        out["run_s"] = run_s
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        # --compile-mode reduce-overhead: graphs inductor ran without CUDA graphs (a CPU input, a mutation, ...)
        out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
        if busy is not None:
            out["busy"] = busy
            out["syncs_per_step"], out["sync_sites"] = syncs, sites[:20]
    return out


def measure(args, size: str) -> dict:
    """Median seconds per step of ours and HF for one size and micro-batch, and each arm's parameter count."""
    gen = torch.Generator().manual_seed(0)
    if args.data:  # real micro-batches, a different one each step, the same sequence for both arms
        host_batches = real_batches(args.data, args.batch[0], args.seq, args.view_len, args.steps + 2)
    else:
        host_batches = [make_batch(args.batch[0], args.seq, args.view_len, args.vocab, gen)]
    host_batch = host_batches[0]
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in host_batches]  # HF's; ours moves the host one
    batch = batches[0]
    torch.manual_seed(0)

    def ours(off: str = ""):  # off: the AB_OPTIONS option turned off in this arm
        return build_ours(size, args.vocab, args.seq, args.zero_stage, args.precision, args.compile, args.batch[0],
                          arch=args.arch, pooling=args.pooling, trim=off != "trim", fast_dropout=off != "dropout",
                          pin=off != "pin", joint=off != "joint", compile_mode=args.compile_mode,
                          attention="varlen" if off == "varlen" else "auto", unpadded=off != "unpadded",
                          scope="layer" if off == "layer" else "encoder", loader_facts=off != "prepare")

    def hf():
        return build_hf(size, args.vocab, args.seq, args.device, args.precision, args.compile, arch=args.arch,
                        pooling=args.pooling, compile_mode=args.compile_mode)

    res = {}
    # One arm after the other (not interleaved): on a GPU both models' activations would otherwise have
    # to fit at once, which would lower the largest batch. The CPU keeps the alternating trials.
    if args.device == "cuda":
        res["ours"] = _timed_arm("ours", ours, host_batch, args.steps, "cuda", args.profile_out)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        res["hf"] = _timed_arm("hf", hf, batch, args.steps, "cuda", args.profile_out)
        if args.ab:
            gc.collect()
            torch.cuda.empty_cache()
            res["ours_full"] = _timed_arm("ours_full", lambda: ours(args.ab), host_batch, args.steps, "cuda")
        if args.data:  # on the GPU every step reruns the first real batch
            res["padding"] = padding_shares([host_batch])
        res["flops_per_sample"] = timed_flops_per_sample(args, size, [host_batch])
        return res
    # --ab: a third arm, ours with that option off, in the same alternation.
    full = ours(args.ab) if args.ab else None
    ours, hf = ours(), hf()
    warm_up(ours, hf, full, host_batches, batches)
    t_ours, t_hf, t_full = [], [], []
    for i in range(args.steps):  # alternate so drifting machine load hits every arm alike
        t_ours.append(time_one(ours, host_batches[i % len(host_batches)]))
        t_hf.append(time_one(hf, batches[i % len(batches)]))
        if full is not None:
            t_full.append(time_one(full, host_batches[i % len(host_batches)]))
    out = {"ours": {"s": statistics.median(t_ours), "num_params": ours.num_params},
           "hf": {"s": statistics.median(t_hf), "num_params": hf.num_params}}
    if full is not None:
        out["ours_full"] = {"s": statistics.median(t_full)}
    if args.matmul_bound:  # after the timed steps, one more of each
        out["ours"]["matmul_s"] = matmul_seconds(ours, host_batches[0])
        out["hf"]["matmul_s"] = matmul_seconds(hf, batches[0])
    if args.data:
        out["padding"] = padding_shares(host_batches[:args.steps])
    out["flops_per_sample"] = timed_flops_per_sample(args, size, host_batches[:args.steps])
    return out


def timed_flops_per_sample(args, size: str, host_batches: list[dict]) -> float:
    """MFU's FLOPs a sample, the same for every arm: ``batch_flops_per_sample`` at ``--pooling`` with the last layer
    trimmed (ours' default) averaged over the batches the timed steps ran (their real lengths)."""
    shape, pooling = model_shape(size, args.arch), "cls" if args.pooling == "cls" else "mean"
    return statistics.fmean(batch_flops_per_sample(b, shape, args.arch, args.vocab, pooling) for b in host_batches)


def warm_up(ours, hf, full, host_batches: list[dict], batches: list[dict]) -> None:
    """One step of every arm on every batch the timing will use, alternating (CPU), so that the timed steps run on
    the heap a long run settles at. glibc's heap grows at each batch larger or differently shaped than any before,
    and each new page is a fault on first touch: on this project's 2-core VM 10-15 us a fault, up to 250k faults
    (3.5 s) in one BERT-base bf16 step of ours and 90k of HF's, over ours' first three books batches. Warmed up
    with one step, ``--sizes base --batch 8 --steps 3 --data books --precision bf16`` measured ours at 0.80x HF;
    warmed up on every batch, 1.27x (docs/performance.md)."""
    for host_batch, batch in zip(host_batches, batches):
        ours(host_batch)
        hf(batch)
        if full is not None:
            full(host_batch)


def count_ops(step, batch) -> dict:
    """The ops one step dispatches (run it after warm-up): aten ops, sync-forcing ops, and each op by name."""
    with OpCounter() as counter:
        step(batch)
    return {"aten_ops": counter.num_aten, "sync_ops": counter.num_sync, "syncs": dict(counter.syncs.most_common()),
            "ops": dict(counter.ops.most_common())}


def measure_host_cost(args) -> dict:
    """One (ZeRO stage, precision) of --host-cost: the arms built, warmed up (3 steps), ``args.steps`` alternating
    timed steps on one thread, then their ops counted over one more step."""
    torch.set_num_threads(1)
    hc = HOST_COST
    batch = make_batch(hc["batch"], hc["seq"], hc["view_len"], hc["vocab"], torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    # torch's dropout in ours, as a CUDA step runs it (train.fast_dropout is a CPU path; this mode stands in for
    # the host work of a GPU step).
    def ours(**options):
        return build_ours(hc["size"], hc["vocab"], hc["seq"], args.zero_stage, args.precision, args.compile,
                          micro_batch=hc["batch"], fast_dropout=False, **options)

    arms = {"ours": ours()}
    # The layout before train.flat_params (2026-11-25), same process, same trials: what flattening saves.
    arms["ours_per_tensor"] = ours(flat=False)
    # HF gets the AdamW implementation the Engine chose (fused, CPU and CUDA; before 2026-11-24 torch's per-parameter
    # one on the CPU, whose step count .item() per parameter would otherwise count as syncs in one arm only).
    fused = bool(arms["ours"].engine._adamw.defaults.get("fused"))
    arms["hf"] = build_hf(hc["size"], hc["vocab"], hc["seq"], "cpu", args.precision, args.compile, fused=fused)
    if args.ab in HOST_AB:  # e.g. the two passes the joint pass replaced: same process, same trials
        arm, options, _ = HOST_AB[args.ab]
        arms[arm] = ours(**options)
    if args.compile:  # HF as most of its users run it: eager
        arms["hf_eager"] = build_hf(hc["size"], hc["vocab"], hc["seq"], "cpu", args.precision, False, fused=fused)
    for _ in range(3):
        for step in arms.values():
            step(batch)
    times: dict = {arm: [] for arm in arms}
    for _ in range(args.steps):  # alternate so drifting machine load hits every arm alike
        for arm, step in arms.items():
            times[arm].append(time_one(step, batch))
    # The matrix products' share of the "host" time (docs/performance.md: not negligible at these shapes), by the
    # profiler, which is no dispatch mode. Ops are counted last: a compiled function called once under a
    # TorchDispatchMode (the counter) runs eagerly from then on (measured 2026-11-27: 36 instead of 17 ms a step),
    # which made every --compile row before that date an eager one.
    matmul_s = {arm: matmul_seconds(arms[arm], batch) for arm in ("ours", "hf")}
    res = {arm: count_ops(step, batch) for arm, step in arms.items()}
    for arm, t in times.items():
        res[arm].update(s=statistics.median(t), all_s=t, adamw_fused=fused)
    for arm, seconds in matmul_s.items():
        res[arm]["matmul_s"] = seconds
    res["threads"] = torch.get_num_threads()  # still 1 after DeepSpeed and HF were built
    return res


def host_cost_table(rows: list[dict]) -> list[str]:
    """Markdown table of --host-cost rows (zero, precision, ours, hf) and the issue's goal line."""
    header = ("| ZeRO | precision | ours host ms | per-tensor ms | HF host ms | ours / HF | per-tensor / HF "
              "| ours aten ops | per-tensor ops | HF aten ops | ours / HF | ours sync ops | HF sync ops |")
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    goal = None
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['zero_stage']} | {r['precision']} | failed: {r['error'][:60]} |" + " |" * 11)
            continue
        o, pt, h = r["ours"], r["ours_per_tensor"], r["hf"]
        t_ratio, op_ratio = o["s"] / h["s"], o["aten_ops"] / h["aten_ops"]
        lines.append(f"| {r['zero_stage']} | {r['precision']} | {o['s'] * 1e3:.1f} | {pt['s'] * 1e3:.1f} | "
                     f"{h['s'] * 1e3:.1f} | {t_ratio:.2f}x | {pt['s'] / h['s']:.2f}x | {o['aten_ops']:,} | "
                     f"{pt['aten_ops']:,} | {h['aten_ops']:,} | {op_ratio:.2f}x | {o['sync_ops']:,} | "
                     f"{h['sync_ops']:,} |")
        if (r["zero_stage"], r["precision"]) == (2, "bf16"):
            goal = (f"host {t_ratio:.2f}x ({'met' if t_ratio <= 0.5 else 'not met'}), aten ops {op_ratio:.2f}x "
                    f"({'met' if o['aten_ops'] <= h['aten_ops'] else 'not met'})")
    lines += ["", f"Goal: {HOST_COST_GOAL}: " + (goal or "ZeRO-2 bf16 not measured")]
    done = [r for r in rows if "error" not in r]
    timed = [r for r in done if "matmul_s" in r["ours"] and "matmul_s" in r["hf"]]
    if timed:
        lines += ["", "Matrix products in those steps (mm/addmm/bmm self time over one profiled step): at these shapes "
                  "arithmetic and each kernel's fixed cost, not the host's bookkeeping around them:"]
        for r in timed:
            o, h = r["ours"], r["hf"]
            rest_o, rest_h = o["s"] - o["matmul_s"], h["s"] - h["matmul_s"]
            lines.append(f"- ZeRO {r['zero_stage']} {r['precision']}: ours {o['matmul_s'] * 1e3:.1f} ms, HF "
                         f"{h['matmul_s'] * 1e3:.1f} ms; the step without them ours {rest_o * 1e3:.1f} ms, HF "
                         f"{rest_h * 1e3:.1f} ms ({rest_o / rest_h:.2f}x)")
    lines += ["", "Sync-forcing ops per step, by name (metrics.op_count.SYNC_OPS):"]
    for r in done:
        for arm in ("ours", "hf"):
            named = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in r[arm]["syncs"].items())
            lines.append(f"- ZeRO {r['zero_stage']} {r['precision']} {arm}: {named or 'none'}")
    if done:
        lines.append("AdamW in both arms: " + ("fused" if done[0]["hf"]["adamw_fused"] else
                     "torch's per-parameter one: its .item() of each parameter's step count is one sync per "
                     "parameter tensor it updates"))
    eager = [r for r in done if "hf_eager" in r]
    if eager:
        lines += ["", "Compiled ours against HF eager (the same runs):", "",
                  "| ZeRO | precision | ours compiled ms | HF eager ms | ours / HF eager |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['zero_stage']} | {r['precision']} | {r['ours']['s'] * 1e3:.1f} | "
                  f"{r['hf_eager']['s'] * 1e3:.1f} | {r['ours']['s'] / r['hf_eager']['s']:.2f}x |" for r in eager]
    for arm, _, what in HOST_AB.values():
        third = [r for r in done if arm in r]
        if third:
            lines += ["", f"Ours with {what} (the same runs):", "",
                      "| ZeRO | precision | its ms | / HF | aten ops | ours / it |", "|---:|---|---:|---:|---:|---:|"]
            lines += [f"| {r['zero_stage']} | {r['precision']} | {r[arm]['s'] * 1e3:.1f} | "
                      f"{r[arm]['s'] / r['hf']['s']:.2f}x | {r[arm]['aten_ops']:,} | "
                      f"{r['ours']['s'] / r[arm]['s']:.2f}x |" for r in third]
    return lines


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_host_cost(args) -> int:
    """--host-cost: one process per (ZeRO stage, precision); prints the table, writes --json-out."""
    hc = HOST_COST
    load_start = os.getloadavg()
    print(f"host cost: torch {torch.__version__}, deepspeed {_version('deepspeed')}, transformers "
          f"{_version('transformers')}, 1 thread, {SIZES[hc['size']]}, batch {hc['batch']} x seq "
          f"{hc['seq']} (+2 views x {hc['view_len']}), vocab {hc['vocab']}, median of {args.steps} alternating "
          f"steps after 3 warm-up, then ops over 1 more step; compile {args.compile} (ours and HF{'; HF eager beside' if args.compile else ''}); ours with train.flat_params (default), per-tensor without; "
          f"load average {load_start[0]:.2f}")
    rows = []
    for zero in args.zero_stages:
        for precision in args.precisions:
            cmd = [sys.executable, __file__, "--json", "--host-cost", "--zero-stage", str(zero), "--precision",
                   precision, "--steps", str(args.steps)] + (["--compile"] if args.compile else []) + \
                (["--ab", args.ab] if args.ab in HOST_AB else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"ZeRO {zero} {precision}: failed ({tail})", file=sys.stderr)
                rows.append({"zero_stage": zero, "precision": precision, "error": tail})
                continue
            rows.append({"zero_stage": zero, "precision": precision, **json.loads(lines[0][7:])})
    load_end = os.getloadavg()
    print()
    print("\n".join(host_cost_table(rows)))
    if args.compile:  # measured: a compiled function under an OpCounter dispatches its eager ops one by one
        print("With --compile the op and sync columns count eager ops: torch.compile runs a frame eagerly while a "
              "TorchDispatchMode (the op counter) is active; only the host ms are the compiled steps'.")
    print(f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"mode": "host-cost", "torch": torch.__version__, "deepspeed": _version("deepspeed"),
                       "transformers": _version("transformers"), "threads": 1, "model": SIZES[hc["size"]],
                       **hc, "steps": args.steps, "compile": args.compile, "load_avg_start": load_start, "load_avg_end": load_end,
                       "goal": HOST_COST_GOAL, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


def back_to_back_lines(rows: list[dict], steps: int, ab: str = "") -> list[str]:
    """CUDA rows: the table times each step up to its last kernel (a synchronize after each); these lines give
    ``steps`` steps run back to back with one synchronize after the last, as the trainer runs them (its step ends
    without a sync, so the host may start the next step while the GPU finishes this one; HF's step still reads
    its loss). With --ab, the third arm too."""
    lines = []
    for row in rows:
        runs = {arm: row[arm].get("run_samples_per_s") for arm in ("ours", "hf", "ours_full")
                if isinstance(row.get(arm), dict) and row[arm].get("run_samples_per_s")}
        if "ours" in runs and "hf" in runs:
            extra = (f"; ours with {AB_OPTIONS[ab]} {runs['ours_full']:.1f} (ours / that arm "
                     f"{runs['ours'] / runs['ours_full']:.2f}x)" if "ours_full" in runs and ab else "")
            lines.append(f"{row['size']} batch {row['batch']}, {steps} steps back to back (one synchronize at the "
                         f"end): ours {runs['ours']:.1f} samples/s, HF {runs['hf']:.1f}, "
                         f"{runs['ours'] / runs['hf']:.2f}x{extra}")
    return lines


def busy_lines(rows: list[dict]) -> list[str]:
    """CUDA rows profiled with --profile-out: the share of 3 back-to-back steps in which the GPU ran something, per
    arm (issue 24's goal: >= 95%). The profiler's own host work makes it a lower bound."""
    lines = []
    for row in rows:
        busy = {arm: row[arm]["busy"] for arm in ("ours", "hf")
                if isinstance(row.get(arm), dict) and row[arm].get("busy") is not None}
        if busy:
            syncs = {arm: row[arm]["syncs_per_step"] for arm in busy if "syncs_per_step" in row[arm]}
            lines.append(f"{row['size']} batch {row['batch']}: GPU busy over 3 profiled steps back to back "
                         "(a lower bound: the profiler adds host work): "
                         + ", ".join(f"{'HF' if arm == 'hf' else arm} {v:.1%}" for arm, v in busy.items())
                         + ("; host waits for the device in one step (where: --profile-out): "
                            + ", ".join(f"{'HF' if arm == 'hf' else arm} {n}" for arm, n in syncs.items())
                            if syncs else ""))
    return lines


def matmul_tflops(size: int = 8192) -> float:
    """Measured bf16 TFLOP/s of a size^3 matmul on random data (median of 10 after 3 warm-ups)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * size**3 / statistics.median(times) / 1e12


def hf_arm_note(arch: str, device: str) -> str:
    """One line saying what the HF arm is, for the table's header."""
    if arch == "bert":
        return "HF: BertForMaskedLM, SDPA (padded), MLM head on every position, CLEAR loss as usually written"
    attn = hf_attention(arch, device)
    how = ("unpadded inside the attention call" if attn == "flash_attention_2" else
           "padded: transformers' ModernBERT unpads only under flash_attention_2, CUDA with flash-attn")
    return (f"HF: ModernBertForMaskedLM, {attn} ({how}), sparse_prediction (MLM head on masked rows), "
            f"CLEAR loss as usually written")


def set_heap(heap: str) -> str:
    """--heap: ``trainer``, glibc's thresholds as the trainer sets them (train.malloc_mmap_threshold_kib's default),
    or ``glibc``, its own dynamic ones; the arms share the process, so both get the same -> the header's words."""
    from pretrain.config.train import TrainConfig
    from pretrain.training.heap import set_mmap_threshold

    kib = TrainConfig().malloc_mmap_threshold_kib
    if heap == "trainer" and set_mmap_threshold(kib):
        return f"glibc mmap threshold {kib} KiB for both arms (the trainer's train.malloc_mmap_threshold_kib)"
    return "glibc's own mmap threshold for both arms" + (" (MALLOC_MMAP_THRESHOLD_ set, or no glibc)"
                                                        if heap == "trainer" else "")


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation")
"""The ops whose self time --matmul-bound counts as matrix multiplication (CPU: each one kernel)."""


def matmul_seconds(step, batch) -> float:
    """Seconds of one step (after warm-up) spent inside matrix multiplications (MATMUL_OPS' self time, CPU
    profiler): the part of the step that neither arm's host or elementwise work can make cheaper."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batch)
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / 1e6


def matmul_bound_lines(rows: list[dict]) -> list[str]:
    """--matmul-bound: per row, each arm's matmul seconds against its step, and the ratio ours / HF would reach if
    ours did nothing but its matmuls (HF's median step over ours' matmul seconds)."""
    lines = []
    for row in rows:
        o, h = row.get("ours") or {}, row.get("hf") or {}
        if o.get("matmul_s") and h.get("matmul_s"):
            lines.append(f"{row['size']} batch {row['batch']}: matmuls take ours {o['matmul_s']:.2f} s of its "
                         f"{o['step_s']:.2f} s step ({o['matmul_s'] / o['step_s']:.0%}), HF {h['matmul_s']:.2f} s "
                         f"of {h['step_s']:.2f} s ({h['matmul_s'] / h['step_s']:.0%}); ours doing nothing but its "
                         f"matmuls would be {h['step_s'] / o['matmul_s']:.2f}x HF (now "
                         f"{h['step_s'] / o['step_s']:.2f}x)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--arch", choices=ARCHS, default="bert",
                   help="bert: BertForMaskedLM vs ours at SIZES; modernbert: ModernBertForMaskedLM vs ours with "
                   "model.arch=modernbert at configs/models/modernbert-{size}.yaml")
    p.add_argument("--sizes", nargs="+", default=["tiny", "mini"], choices=sorted(set(SIZES) | set(MODERN_SIZES)))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--view-len", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[32],
                   help="micro-batch sizes, ascending; a size stops at the first batch that does not fit")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--data", choices=DATA_SOURCES, default="",
                   help="real micro-batches of this shared corpus (CLEAR's masking and views, padded as collate "
                   "pads them; on the CPU a new one each step, on CUDA the first one every step) instead of the "
                   "synthetic full-length batch; vocab 30522 ($PRETRAIN_DATA_DIR, $PRETRAIN_BERT_TOKENIZER: "
                   "tools/gpu_data.sh)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--pooling", choices=sorted(POOLINGS), default="mean",
                   help="the views' embedding in both arms: their mean (the quickstart's) or their [CLS] state (the "
                   "CLEAR recipes')")
    p.add_argument("--ab", choices=sorted(AB_OPTIONS), default="",
                   help="a third arm, ours with this option off: trim (train.trim_last_layer=false), dropout "
                   "(train.fast_dropout=false), pin (train.pin_memory=false; CUDA only), joint "
                   "(train.joint_pass=false), varlen (train.unpadded_attention=varlen, where auto is groups; BERT) "
                   "unpadded (train.unpadded=false: the padded step), layer (train.flat_scope=layer) or prepare "
                   "(the batch packed inside the step, not by the loader's workers) (CPU: alternating with the other "
                   "two; CUDA: after them)")
    p.add_argument("--trim-ab", dest="ab", action="store_const", const="trim", help="--ab trim")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile: ours as train.compile (forward + losses, "
                   "unpadded in the fixed attention layout), HF's whole model")
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="--compile: torch.compile's mode in both arms (ours: train.compile_mode); reduce-overhead "
                   "captures CUDA graphs (a GPU)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak for MFU (H100 SXM 989, H200 989, A100 312)")
    p.add_argument("--json-out", default="", help="also write every figure to this JSON file")
    p.add_argument("--profile-out", default="", help="CUDA: append each arm's kernel table (torch.profiler) here")
    p.add_argument("--host-cost", action="store_true",
                   help="CPU: host ms, aten ops and sync-forcing ops per step at BERT-base depth and no width")
    p.add_argument("--zero-stages", type=int, nargs="+", default=[0, 2], help="--host-cost: ZeRO stages")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="--host-cost: precisions")
    p.add_argument("--heap", choices=["trainer", "glibc"], default="trainer",
                   help="glibc's heap thresholds for both arms (one process): the trainer's "
                   "(train.malloc_mmap_threshold_kib) or glibc's own")
    p.add_argument("--matmul-bound", action="store_true",
                   help="CPU: also profile one step of each arm and print the seconds spent in matmuls, and the "
                   "ratio ours would reach doing nothing else")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one (size, batch) as JSON (internal)
    args = p.parse_args(argv)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    heap = set_heap(args.heap)
    if args.matmul_bound and args.device != "cpu":
        p.error("--matmul-bound profiles CPU steps; leave out --device")
    if args.host_cost and args.device != "cpu":
        p.error("--host-cost measures the host on the CPU (wall time = host time there); leave out --device")
    if args.host_cost and args.arch != "bert":
        p.error("--host-cost measures BERT-base depth only; leave out --arch")
    if args.data and (args.vocab != 30522 or args.host_cost):
        p.error("--data batches are BERT's 30522-token WordPiece ids at the bench's sizes; leave out --vocab and "
                "--host-cost")
    available = MODERN_SIZES if args.arch == "modernbert" else tuple(SIZES)
    if not set(args.sizes) <= set(available):
        p.error(f"--arch {args.arch} has sizes {', '.join(available)}; got {' '.join(args.sizes)}")
    if args.json:
        print("RESULT " + json.dumps(measure_host_cost(args) if args.host_cost else measure(args, args.sizes[0])))
        return 0
    if args.host_cost:
        return run_host_cost(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_start = os.getloadavg()[0]
    mm = matmul_tflops() if args.device == "cuda" else None
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    each = "the first one every step" if args.device == "cuda" else "a new one each step"
    print(f"device {name}, torch {torch.__version__}, transformers {_version('transformers')}, arch {args.arch}, "
          f"precision {args.precision}, zero {args.zero_stage}, compile {args.compile}"
          f"{f' ({args.compile_mode})' if args.compile else ''}, pooling {args.pooling}, "
          f"seq {args.seq} (+2 views x "
          f"{args.view_len}), vocab {args.vocab}, median of {args.steps} steps"
          f"{' after one warm-up step of each arm on every batch' if args.device == 'cpu' else ''}, "
          f"{f'real batches of the shared {args.data} ({each})' if args.data else 'synthetic batch'}"
          + (f", measured bf16 matmul {mm:.0f} TFLOP/s" if mm else "") + f", {heap}")
    print(hf_arm_note(args.arch, args.device))
    layout = TrainConfig(compile=args.compile).unpadded_layout(args.arch)
    print(f"ours: {f'unpadded, attention layout {layout}' if layout else 'padded'} "
          "(train.unpadded_attention=auto)" + (f"; third arm {AB_OPTIONS[args.ab]}" if args.ab else ""))
    rows = []
    for size in args.sizes:
        for b in args.batch:
            # One process per (size, batch): a DeepSpeed engine and its hooks stay alive until the process
            # ends, and an out-of-memory leaves nothing behind.
            cmd = [sys.executable, __file__, "--json", "--arch", args.arch, "--sizes", size, "--seq", str(args.seq),
                   "--view-len",
                   str(args.view_len), "--batch", str(b), "--vocab", str(args.vocab), "--steps", str(args.steps),
                   "--zero-stage", str(args.zero_stage), "--device", args.device, "--precision", args.precision]
            cmd += ["--compile", "--compile-mode", args.compile_mode] if args.compile else []
            cmd += ["--pooling", args.pooling] + (["--ab", args.ab] if args.ab else [])
            cmd += ["--data", args.data] if args.data else []
            cmd += ["--profile-out", args.profile_out] if args.profile_out else []
            cmd += ["--heap", args.heap] + (["--matmul-bound"] if args.matmul_bound else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"size {size} batch {b}: failed ({tail})", file=sys.stderr)
                rows.append(dict(size=size, batch=b, error=tail))
                break
            r = json.loads(lines[0][7:])
            flops = r.get("flops_per_sample") or train_flops_per_sample(size, args.seq, args.view_len, args.vocab,
                                                                         arch=args.arch, pooling=args.pooling)
            row = dict(size=size, batch=b, flops_per_sample=flops, padding=r.get("padding"))
            for arm in ("ours", "hf"):
                a = r[arm]
                if a.get("oom"):
                    row[arm] = {"oom": True}
                    continue
                sps = b / a["s"]
                row[arm] = dict(step_s=a["s"], samples_per_s=sps, tflops=sps * flops / 1e12,
                                mfu=sps * flops / 1e12 / args.peak_tflops,
                                frac_of_matmul=(sps * flops / 1e12 / mm) if mm else None,
                                peak_gib=a.get("peak_gib"), num_params=a.get("num_params"),
                                cudagraph_skips=a.get("cudagraph_skips"), busy=a.get("busy"))
                if a.get("run_s"):
                    row[arm]["run_samples_per_s"] = b / a["run_s"]
                if a.get("matmul_s"):
                    row[arm]["matmul_s"] = a["matmul_s"]
            if "ours_full" in r and not r["ours_full"].get("oom"):
                row["ours_full"] = dict(samples_per_s=b / r["ours_full"]["s"],
                                        run_samples_per_s=b / r["ours_full"]["run_s"] if r["ours_full"].get("run_s")
                                        else None)
            rows.append(row)
            if row["ours"].get("oom") and row["hf"].get("oom"):
                break
    print("\n| arch | size | batch | ours samples/s | HF samples/s | ours / HF | ours MFU | HF MFU | ours GiB | HF GiB "
          "| ours params | HF params |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {args.arch} | {row['size']} | {row['batch']} | failed: {row['error'][:60]} | | | | | | | | |")
            continue
        o, h = row["ours"], row["hf"]

        def cell(a, key, fmt):
            return "OOM" if a.get("oom") else (fmt.format(a[key]) if a.get(key) is not None else "-")

        ratio = f"{o['samples_per_s'] / h['samples_per_s']:.2f}x" if not (o.get("oom") or h.get("oom")) else "-"
        print(f"| {args.arch} | {row['size']} | {row['batch']} | {cell(o, 'samples_per_s', '{:.1f}')} | "
              f"{cell(h, 'samples_per_s', '{:.1f}')} | {ratio} | {cell(o, 'mfu', '{:.1%}')} | "
              f"{cell(h, 'mfu', '{:.1%}')} | {cell(o, 'peak_gib', '{:.1f}')} | {cell(h, 'peak_gib', '{:.1f}')} | "
              f"{cell(o, 'num_params', '{:,}')} | {cell(h, 'num_params', '{:,}')} |")
    for row in rows:
        if row.get("ours_full") and not row["ours"].get("oom"):
            full, hf_sps = row["ours_full"]["samples_per_s"], row["hf"].get("samples_per_s")
            print(f"{row['size']} batch {row['batch']}: ours with {AB_OPTIONS[args.ab]} {full:.1f} samples/s "
                  f"({full / hf_sps:.2f}x HF); ours / that arm {row['ours']['samples_per_s'] / full:.2f}x"
                  if hf_sps else f"{row['size']}: ours with {AB_OPTIONS[args.ab]} {full:.1f} samples/s")
    for line in back_to_back_lines(rows, args.steps, args.ab) + busy_lines(rows) + matmul_bound_lines(rows):
        print(line)
    for row in rows:
        skips = {arm: row[arm].get("cudagraph_skips") for arm in ("ours", "hf") if isinstance(row.get(arm), dict)}
        if args.compile and args.compile_mode == "reduce-overhead" and any(skips.values()):
            print(f"{row['size']} batch {row['batch']}: graphs run without CUDA graphs (inductor's cudagraph_skips): "
                  f"{skips}")
    for row in rows:
        if row.get("padding"):
            print(f"{row['size']} batch {row['batch']}: padding in the timed batches: {row['padding']['mlm']:.1%} of "
                  f"the MLM rows' tokens, {row['padding']['views']:.1%} of the views' (MFU counts real tokens only)")
    load_end = os.getloadavg()[0]
    print(f"load average {load_start:.2f} at the start, {load_end:.2f} at the end")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, arch=args.arch, hf_attention=hf_attention(
                           args.arch, args.device), precision=args.precision,
                           zero_stage=args.zero_stage, compile=args.compile,
                           compile_mode=args.compile_mode if args.compile else None, seq=args.seq,
                           view_len=args.view_len, vocab=args.vocab, matmul_tflops=mm,
                           peak_tflops=args.peak_tflops, load_avg_start=load_start, load_avg_end=load_end,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
