"""STS evaluation: STS12–16, STS-B, SICK-R; cosine similarity, Spearman ×100, both conventions.

Conventions reported per task (as in SentEval's results dict):
  all   — SimCSE's: concatenate a year's subsets, one Spearman (what SimCSE/RankCSE tables show);
  mean  — SentEval's: mean of per-subset Spearman;  wmean — the same weighted by subset size.
STS-B and SICK-R have one subset, so the three coincide. Data layout: see shared/data/MANIFEST.md §1.

Legend: N pairs, D embedding size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr

from pretrain.eval.encoder import EncodeFn

STS_SUBSETS = {
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),  # SMT is LDC-licensed and absent, as in SentEval's release
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
TASKS = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")
EXTRA_TASKS = ("STSBenchmark-dev",)
TABLE_NAMES = {"STS12": "STS12", "STS13": "STS13", "STS14": "STS14", "STS15": "STS15", "STS16": "STS16",
               "STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}
VARIANTS = ("senteval", "original")


@dataclass(kw_only=True)
class StsSubset:
    name: str
    sent_a: list[str]
    sent_b: list[str]
    gold: np.ndarray
    """float64 [N] gold similarity."""


@dataclass(kw_only=True)
class StsTask:
    name: str
    subsets: list[StsSubset]


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; point --data-dir at the STS data (SentEval layout)")
    with open(path, encoding="utf-8", newline="") as f:
        return [ln.rstrip("\r") for ln in f.read().split("\n")]


def _score(text: str, path: Path, lineno: int) -> float:
    """A gold similarity read from ``path`` line ``lineno``: a finite number, else a ValueError naming both."""
    try:
        y = float(text)
    except ValueError:
        y = float("nan")
    if not np.isfinite(y):
        raise ValueError(f"{path} line {lineno}: gold score {text.strip()!r} is not a finite number; is this the "
                         f"file SentEval reads (shared/data/MANIFEST.md §1)?")
    return y


def _norm(s: str) -> str:
    """SentEval splits on whitespace and the batcher re-joins with single spaces."""
    return " ".join(s.split())


def read_sts_year(data_dir: str | Path, year: str, variant: str = "senteval") -> StsTask:
    """STS12–16: `STS.input.<subset>.txt` (tab pairs) + `STS.gs.<subset>.txt`; blank gold lines dropped."""
    if year not in STS_SUBSETS:
        raise ValueError(f"unknown STS year {year!r}; choose one of {sorted(STS_SUBSETS)}")
    root = Path(data_dir) / "sts" / ("original" if variant == "original" else "") / f"{year}-en-test"
    prefix = "STS2016" if (variant == "original" and year == "STS16") else "STS"
    subsets = []
    for sub in STS_SUBSETS[year]:
        inp_path, gs_path = root / f"{prefix}.input.{sub}.txt", root / f"{prefix}.gs.{sub}.txt"
        inp, gs = _lines(inp_path), _lines(gs_path)
        if inp and inp[-1] == "":
            inp = inp[:-1]
        # Lines are aligned by number; a score past the last pair means the two files do not belong together.
        beyond = [n for n in range(len(inp), len(gs)) if gs[n].strip()]
        if beyond:
            raise ValueError(f"{gs_path} line {beyond[0] + 1}: a gold score beyond the {len(inp)} pairs of "
                             f"{inp_path.name}; the input and gold files are not aligned")
        gs = gs[: len(inp)]
        if len(gs) != len(inp):
            raise ValueError(f"{root}/{sub}: {len(inp)} input lines but {len(gs)} gold lines")
        a, b, y = [], [], []
        for n, (line, g) in enumerate(zip(inp, gs)):
            if g.strip() == "":
                continue
            cols = line.split("\t")
            if len(cols) < 2:
                raise ValueError(f"{inp_path} line {n + 1}: expected 2 tab-separated columns")
            a.append(_norm(cols[0]))
            b.append(_norm(cols[1]))
            y.append(_score(g, gs_path, n + 1))
        subsets.append(StsSubset(name=sub, sent_a=a, sent_b=b, gold=np.asarray(y, dtype=np.float64)))
    return StsTask(name=year, subsets=subsets)


def read_stsb(data_dir: str | Path, split: str = "test", variant: str = "senteval") -> StsTask:
    """STS Benchmark `sts-<split>.csv`: tab-separated, score col 4, sentences cols 5 and 6."""
    path = Path(data_dir) / "sts" / ("original" if variant == "original" else "") / "STSBenchmark" / f"sts-{split}.csv"
    a, b, y = [], [], []
    for n, line in enumerate(_lines(path)):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) < 7:
            raise ValueError(f"{path} line {n + 1}: expected >= 7 tab-separated columns")
        a.append(_norm(cols[5]))
        b.append(_norm(cols[6]))
        y.append(_score(cols[4], path, n + 1))
    sub = StsSubset(name=f"sts-{split}", sent_a=a, sent_b=b, gold=np.asarray(y, dtype=np.float64))
    return StsTask(name="STSBenchmark" if split == "test" else f"STSBenchmark-{split}", subsets=[sub])


def read_sickr(data_dir: str | Path, split: str = "test") -> StsTask:
    """SICK relatedness (header line; test file has CRLF): sentence_A, sentence_B, relatedness_score."""
    fname = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
    path = Path(data_dir) / "sts" / "SICK" / fname
    lines = [(n + 1, ln) for n, ln in enumerate(_lines(path)) if ln.strip()]
    header = lines[0][1].split("\t") if lines else []
    need = ("sentence_A", "sentence_B", "relatedness_score")
    if any(c not in header for c in need):
        raise ValueError(f"{path}: the first line must be SICK's header naming {', '.join(need)}; got {header}")
    ia, ib, iy = (header.index(c) for c in need)
    a, b, y = [], [], []
    for lineno, ln in lines[1:]:
        r = ln.split("\t")
        if len(r) <= max(ia, ib, iy):
            raise ValueError(f"{path} line {lineno}: expected {len(header)} tab-separated columns, got {len(r)}")
        a.append(_norm(r[ia]))
        b.append(_norm(r[ib]))
        y.append(_score(r[iy], path, lineno))
    sub = StsSubset(name=f"SICK-{split}", sent_a=a, sent_b=b, gold=np.asarray(y, dtype=np.float64))
    return StsTask(name="SICKRelatedness", subsets=[sub])


def load_sts_task(data_dir: str | Path, name: str, variant: str = "senteval") -> StsTask:
    """One of TASKS (+ 'STSBenchmark-dev'); variant 'original' = untokenized releases (no SICK)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if name in STS_SUBSETS:
        return read_sts_year(data_dir, name, variant)
    if name == "STSBenchmark":
        return read_stsb(data_dir, "test", variant)
    if name == "STSBenchmark-dev":
        return read_stsb(data_dir, "dev", variant)
    if name == "SICKRelatedness":
        return read_sickr(data_dir, "test")  # SICK has no separate untokenized copy here
    raise ValueError(f"unknown STS task {name!r}; choose from {TASKS + EXTRA_TASKS}")


def cosine(u_ND: np.ndarray, v_ND: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity in float64: [N]."""
    u, v = u_ND.astype(np.float64), v_ND.astype(np.float64)
    nu = np.linalg.norm(u, axis=1).clip(min=1e-12)
    nv = np.linalg.norm(v, axis=1).clip(min=1e-12)
    return (u * v).sum(1) / (nu * nv)


def embed_task(encode_fn: EncodeFn, task: StsTask) -> dict[str, np.ndarray]:
    """Encode every distinct sentence of the task once: {sentence: embedding [D]}."""
    uniq = sorted({s for sub in task.subsets for s in (*sub.sent_a, *sub.sent_b)})
    emb_ND = np.asarray(encode_fn(uniq))
    if emb_ND.shape[0] != len(uniq):
        raise ValueError(f"encode_fn returned {emb_ND.shape[0]} rows for {len(uniq)} sentences")
    return dict(zip(uniq, emb_ND))


def predict_similarities(encode_fn: EncodeFn, task: StsTask) -> list[np.ndarray]:
    """Cosine similarity per pair, one array per subset."""
    emb = embed_task(encode_fn, task)
    return [cosine(np.stack([emb[s] for s in sub.sent_a]), np.stack([emb[s] for s in sub.sent_b]))
            for sub in task.subsets]


def sts_metrics(task: StsTask, sims: list[np.ndarray]) -> dict:
    """Spearman/Pearson ×100: per subset, 'all' (concatenated), 'mean' and 'wmean' (SentEval)."""
    per, n = {}, []
    for sub, s in zip(task.subsets, sims):
        per[sub.name] = {"spearman": 100 * spearmanr(s, sub.gold)[0], "pearson": 100 * pearsonr(s, sub.gold)[0],
                         "n": len(s)}
        n.append(len(s))
    w = np.asarray(n, dtype=np.float64) / sum(n)
    all_s, all_g = np.concatenate(sims), np.concatenate([sub.gold for sub in task.subsets])
    out = {"subsets": per, "n": int(sum(n))}
    for m, fn in (("spearman", spearmanr), ("pearson", pearsonr)):
        vals = np.asarray([per[k][m] for k in per])
        out[m] = {"all": float(100 * fn(all_s, all_g)[0]), "mean": float(vals.mean()), "wmean": float(vals @ w)}
    return out


def evaluate_sts(encode_fn: EncodeFn, data_dir: str | Path, tasks=TASKS, variant: str = "senteval",
                 return_sims: bool = False):
    """{task: metrics} for the given tasks (and the per-subset similarities if return_sims)."""
    results, all_sims = {}, {}
    for name in tasks:
        task = load_sts_task(data_dir, name, variant)
        sims = predict_similarities(encode_fn, task)
        results[name] = sts_metrics(task, sims)
        all_sims[name] = (task, sims)
    return (results, all_sims) if return_sims else results


def sts_markdown_table(rows: dict[str, dict], metric: str = "spearman") -> str:
    """Papers' layout: STS12 … SICK-R, Avg.; one line per (model, convention in all/mean/wmean)."""
    cols = [t for t in TASKS]
    lines = ["| Model | Conv. | " + " | ".join(TABLE_NAMES[c] for c in cols) + " | Avg. |",
             "|" + "---|" * (len(cols) + 3)]
    for model, res in rows.items():
        for conv in ("all", "mean", "wmean"):
            vals = [res[c][metric][conv] if c in res else None for c in cols]
            got = [v for v in vals if v is not None]
            cells = [f"{v:.2f}" if v is not None else "–" for v in vals]
            avg = f"{np.mean(got):.2f}" if len(got) == len(cols) else "–"
            lines.append(f"| {model} | {conv} | " + " | ".join(cells) + f" | {avg} |")
    return "\n".join(lines) + "\n"


class StsbDevEvaluator:
    """Spearman ×100 on STS-B dev for keep-best during training: `evaluator(encode_fn) -> float`."""

    def __init__(self, data_dir: str | Path, *, variant: str = "senteval", max_pairs: int = 0):
        self.task = load_sts_task(data_dir, "STSBenchmark-dev", variant)
        if max_pairs:
            sub = self.task.subsets[0]
            self.task.subsets[0] = StsSubset(name=sub.name, sent_a=sub.sent_a[:max_pairs],
                                             sent_b=sub.sent_b[:max_pairs], gold=sub.gold[:max_pairs])

    def __call__(self, encode_fn: EncodeFn) -> float:
        sims = predict_similarities(encode_fn, self.task)
        return float(100 * spearmanr(sims[0], self.task.subsets[0].gold)[0])
