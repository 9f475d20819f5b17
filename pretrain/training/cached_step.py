"""One optimizer step under ``objective.gradient_cache``: the contrastive terms see every sentence of the step
(train.micro_batch_size x train.grad_accum x ranks), and a micro-batch is only the chunk held in memory.

The step's train.grad_accum micro-batches are the chunks. Pass 1 embeds each without a graph, the contrastive
stage computes the terms on the whole step and their gradient with respect to the embeddings, pass 2 re-runs
each chunk with a graph and back-propagates that gradient plus the chunk's per-sample terms (the arithmetic is
``objective/grad_cache.py``'s). Each chunk's two passes draw the same dropout masks: both run under an RNG keyed
by (seed, step, rank, chunk). Like ``step.optimizer_step`` it forces no host-device sync.
"""

from __future__ import annotations

import numpy as np
import torch

from pretrain.objective.grad_cache import contrast
from pretrain.training.heap import trim
from pretrain.training.step import (
    HostFacts,
    StepResult,
    all_finite,
    count_tokens,
    seeded_rng,
    step_facts,
    to_device,
)


def cached_optimizer_step(engine, next_batch, sums, *, env, grad_accum: int, seed: int, step: int,
                          precision: str, unpadded: bool | str = False, trim_heap: bool = False,
                          pin_memory: bool = False) -> StepResult:
    """``step.optimizer_step`` with the contrastive batch the whole step: the same arguments and result.
    ``trim_heap`` (train.malloc_trim_chunks; CPU only): glibc's heap is trimmed after each chunk's backward, so
    that the freed activations of chunks of different sizes do not pile up in it (heap.trim)."""
    trim_heap = trim_heap and torch.device(engine.device).type == "cpu"
    batches, n_samples, n_tokens = [], 0, 0
    for _ in range(grad_accum):
        batch = next_batch()  # counted on the host, then moved: no device sync
        n_samples += batch["input_ids"].shape[0]
        n_tokens += count_tokens(batch)
        batches.append(to_device(step_facts(batch, HostFacts(unpadded)), engine.device, pin=pin_memory))
    embedded = []
    with torch.no_grad():
        for k, batch in enumerate(batches):
            with chunk_rng(seed, step, env.rank, k, engine.device):
                embedded.append(engine.forward(batch, embed_only=True))
    cache = contrast(engine.module.objective, embedded)
    finite_c = torch.isfinite(cache.loss)
    sums.update(cache.metrics, keep=finite_c)
    step_loss, all_finite_t = cache.loss, finite_c
    for k, batch in enumerate(batches):
        with chunk_rng(seed, step, env.rank, k, engine.device):
            loss, value, metrics = engine.forward(batch, cached=cache.chunks[k])
        finite = torch.isfinite(loss.detach()) & finite_c  # decided on the device, as in optimizer_step
        sums.update(metrics, keep=finite)
        step_loss = step_loss + value
        all_finite_t = all_finite_t & finite
        # x grad_accum: DeepSpeed divides each micro-step's loss by it, but these losses are already the step's.
        engine.micro_step(loss * grad_accum, finite=finite)
        if trim_heap:
            trim()
    sums.add("loss", step_loss, 1, keep=all_finite_t)  # the whole step's loss, x world size like optimizer_step's
    info = engine.step()
    bad = info.skipped if precision != "fp16" else not all_finite(all_finite_t, env)
    return StepResult(info=info, bad=bad, samples=n_samples, tokens=n_tokens, loss=step_loss.detach())


def chunk_rng(seed: int, step: int, rank: int, chunk: int, device):
    """The RNG (dropout) of one chunk keyed by (seed, step, rank, chunk), scoped like ``step.dropout_rng``: pass 1
    and pass 2 of a chunk draw the same masks."""
    key = np.random.SeedSequence([seed, step, rank, chunk]).generate_state(1, np.uint64)[0]
    return seeded_rng(int(key) % (2**63), device)
