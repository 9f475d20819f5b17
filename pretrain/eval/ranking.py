"""Ranking metrics KCC and NDCG on STS sets, following RankCSE's appendix G.

For a sentence x_i that occurs in more than three scored pairs (x_i, x_i^j, y_i^j) of a dataset, the
pairs form one ranking sample. KCC = Kendall's tau-b between predicted cosine and gold scores over
the sample; NDCG ranks the partners by predicted cosine with gold scores as (linear) gains and a
log2 discount, over the whole list. Both are averaged over samples, ×100. Samples whose gold scores
are all equal have no defined KCC and are skipped for KCC (counted in `num_kcc_skipped`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from scipy.stats import kendalltau

from pretrain.eval.sts import TABLE_NAMES, TASKS, StsTask


def ranking_samples(task: StsTask, sims: list[np.ndarray], min_pairs: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """(pred_K, gold_K) per anchor sentence with >= min_pairs scored pairs (appendix G: k > 3)."""
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for sub, s in zip(task.subsets, sims):
        for a, b, g, p in zip(sub.sent_a, sub.sent_b, sub.gold, s):
            groups[a].append((float(p), float(g)))
            if b != a:
                groups[b].append((float(p), float(g)))
    out = []
    for pairs in groups.values():
        if len(pairs) >= min_pairs:
            arr = np.asarray(pairs, dtype=np.float64)
            out.append((arr[:, 0], arr[:, 1]))
    return out


def ndcg(pred_K: np.ndarray, gold_K: np.ndarray) -> float:
    """NDCG over the full list: partners ordered by pred (ties: stable order), gains = gold."""
    disc = 1.0 / np.log2(np.arange(2, len(gold_K) + 2))
    dcg = float(gold_K[np.argsort(-pred_K, kind="stable")] @ disc)
    idcg = float(np.sort(gold_K)[::-1] @ disc)
    return dcg / idcg if idcg > 0 else 0.0


def ranking_metrics(task: StsTask, sims: list[np.ndarray], min_pairs: int = 4) -> dict:
    """{'kcc', 'ndcg' (×100), 'num_samples', 'num_kcc_skipped'} for one STS task."""
    samples = ranking_samples(task, sims, min_pairs)
    if not samples:
        return {"kcc": float("nan"), "ndcg": float("nan"), "num_samples": 0, "num_kcc_skipped": 0}
    taus = [kendalltau(p, g)[0] for p, g in samples]
    ok = [t for t in taus if not np.isnan(t)]
    return {
        "kcc": 100 * float(np.mean(ok)) if ok else float("nan"),
        "ndcg": 100 * float(np.mean([ndcg(p, g) for p, g in samples])),
        "num_samples": len(samples),
        "num_kcc_skipped": len(taus) - len(ok),
    }


def ranking_markdown_table(rows: dict[str, dict]) -> str:
    """RankCSE Table 13 layout: one KCC and one NDCG line per model over the STS tasks + avg."""
    lines = ["| Metric | Model | " + " | ".join(TABLE_NAMES[t] for t in TASKS) + " | avg. |",
             "|" + "---|" * (len(TASKS) + 3)]
    for metric in ("kcc", "ndcg"):
        for model, res in rows.items():
            vals = [res[t][metric] if t in res else None for t in TASKS]
            cells = [f"{v:.2f}" if v is not None else "–" for v in vals]
            avg = f"{np.mean(vals):.2f}" if all(v is not None for v in vals) else "–"
            lines.append(f"| {metric.upper()} | {model} | " + " | ".join(cells) + f" | {avg} |")
    return "\n".join(lines) + "\n"
