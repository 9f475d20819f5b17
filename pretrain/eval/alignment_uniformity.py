"""Alignment and uniformity (Wang & Isola, 2020) of normalised embeddings, as in the seeds' appendices.

  align   = E_{(x,y)~p_pos} ||f(x) - f(y)||^alpha          (alpha = 2)
  uniform = log E_{x,y~p_data} exp(-t ||f(x) - f(y)||^2)    (t = 2)
On STS-B dev (SimCSE's setup): p_pos = pairs with gold score > 4, p_data = all sentences of the set
(every unordered pair of distinct sentences). Smaller is better for both.

Legend: N sentences, P positive pairs, D embedding size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrain.eval.encoder import EncodeFn
from pretrain.eval.sts import StsTask, load_sts_task


def normalize(x_ND: np.ndarray) -> np.ndarray:
    x = np.asarray(x_ND, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(min=1e-12)


def alignment(x_PD: np.ndarray, y_PD: np.ndarray, alpha: float = 2.0) -> float:
    """Mean ||x - y||^alpha over positive pairs of normalised embeddings."""
    return float(np.mean(np.linalg.norm(normalize(x_PD) - normalize(y_PD), axis=1) ** alpha))


def uniformity(x_ND: np.ndarray, t: float = 2.0, chunk: int = 2048) -> float:
    """log of the mean Gaussian potential over all pairs i < j (torch.pdist convention), chunked."""
    z = normalize(x_ND)
    n = len(z)
    if n < 2:
        raise ValueError("uniformity needs at least 2 embeddings")
    total, count = 0.0, 0
    # exp(-t d^2) with d^2 = 2 - 2 cos for unit vectors; pairs i < j only
    for s in range(0, n, chunk):
        cos_CN = z[s : s + chunk] @ z.T
        sq = np.clip(2.0 - 2.0 * cos_CN, 0.0, None)
        rows = np.arange(s, min(s + chunk, n))[:, None]
        upper = np.arange(n)[None, :] > rows
        total += float(np.exp(-t * sq)[upper].sum())
        count += int(upper.sum())
    return float(np.log(total / count))


def alignment_uniformity(encode_fn: EncodeFn, task: StsTask, pos_threshold: float = 4.0) -> dict:
    """{'align', 'uniform', 'num_pos', 'num_sentences'} for an STS task (all subsets together)."""
    a = [s for sub in task.subsets for s in sub.sent_a]
    b = [s for sub in task.subsets for s in sub.sent_b]
    gold = np.concatenate([sub.gold for sub in task.subsets])
    uniq = sorted(set(a) | set(b))
    emb = dict(zip(uniq, np.asarray(encode_fn(uniq))))
    pos = np.nonzero(gold > pos_threshold)[0]
    if len(pos) == 0:
        raise ValueError(f"no pairs with gold score > {pos_threshold} in {task.name}")
    ea = np.stack([emb[a[i]] for i in pos])
    eb = np.stack([emb[b[i]] for i in pos])
    return {"align": alignment(ea, eb), "uniform": uniformity(np.stack([emb[s] for s in uniq])),
            "num_pos": int(len(pos)), "num_sentences": len(uniq)}


def stsb_alignment_uniformity(encode_fn: EncodeFn, data_dir: str | Path, variant: str = "senteval") -> dict:
    """Alignment/uniformity on STS-B dev, the seeds' setting."""
    return alignment_uniformity(encode_fn, load_sts_task(data_dir, "STSBenchmark-dev", variant))
