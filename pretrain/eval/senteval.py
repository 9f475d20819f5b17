"""SentEval transfer tasks: MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC; logistic regression on frozen embeddings.

Protocol (SentEval's): MR/CR/SUBJ/MPQA — nested stratified 10-fold CV (the L2 strength C is chosen by an
inner k-fold on each outer training part); TREC, MRPC — C chosen by k-fold CV on train over SentEval's
KFoldClassifier grid (2^-1 … 2^5, not the 2^-2 … 2^3 of the other two), refit, test accuracy; SST-2 — C chosen
on dev, test accuracy. Files are read as SentEval does (latin-1 for the
single-sentence tasks and TREC, utf-8 for SST and MRPC; `str.splitlines`, empty lines kept).

That is SentEval's scikit-learn path (``usepytorch=False``, the default here). ``ClassifierConfig(backend="pytorch")``
runs its PyTorch path instead, the one behind the SimCSE, ArcCSE and RankCSE transfer tables (``senteval_torch``).

Legend: N examples, D embedding size, F feature size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.checkpoint.files import atomic_write_text
from pretrain.console import verbose
from pretrain.eval.encoder import EncodeFn
from pretrain.eval.senteval_torch import evaluate_features
from pretrain.eval.transfer_setup import ClassifierConfig, _jobs, _run_all, binary_f1, senteval_best

TASKS = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")
TREC_CLASSES = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")
BINARY_FILES = {
    "MR": ("MR/rt-polarity.pos", "MR/rt-polarity.neg"),
    "CR": ("CR/custrev.pos", "CR/custrev.neg"),
    "SUBJ": ("SUBJ/subj.objective", "SUBJ/subj.subjective"),
    "MPQA": ("MPQA/mpqa.pos", "MPQA/mpqa.neg"),
}
"""(label-1 file, label-0 file) under <data>/senteval/, as SentEval labels them (SUBJ: objective = 1)."""


@dataclass(kw_only=True)
class TransferData:
    """Sentences and labels per split; `pairs` tasks hold (a, b) per example."""

    splits: dict[str, tuple[list, np.ndarray]] = field(default_factory=dict)
    pairs: bool = False


def _read(path: Path, encoding: str) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; point --data-dir at the shared data (senteval/ inside)")
    with open(path, encoding=encoding) as f:
        return f.read().splitlines()


def _join(line: str) -> str:
    return " ".join(line.split())


def senteval_order(data: TransferData) -> TransferData:
    """Each split in the order SentEval's ``run`` sorts it before embedding ("to reduce padding"): by (words, label),
    MRPC by (words of a, words of b, label); a stable sort, ties in file order. The folds of the k-fold selections
    are drawn over this order (StratifiedKFold's shuffle permutes positions), so the same embeddings get SentEval's
    folds only in it."""
    out = {}
    for split, (x, y) in data.splits.items():
        if data.pairs:
            keys = [(len(a.split()), len(b.split()), int(lab)) for (a, b), lab in zip(x, y)]
        else:
            keys = [(len(s.split()), int(lab)) for s, lab in zip(x, y)]
        order = sorted(range(len(x)), key=keys.__getitem__)
        out[split] = ([x[i] for i in order], y[np.asarray(order, dtype=np.int64)])
    return TransferData(splits=out, pairs=data.pairs)


def load_transfer_task(data_dir: str | Path, name: str) -> TransferData:
    """One task from <data_dir>/senteval/ ('all' for CV tasks; train/dev/test else), each split in SentEval's
    order (``senteval_order``)."""
    return senteval_order(_load_task(data_dir, name))


def _load_task(data_dir: str | Path, name: str) -> TransferData:
    root = Path(data_dir) / "senteval"
    if name in BINARY_FILES:
        pos, neg = (_read(root / f, "latin-1") for f in BINARY_FILES[name])
        x = [_join(s) for s in pos + neg]
        y = np.asarray([1] * len(pos) + [0] * len(neg), dtype=np.int64)
        return TransferData(splits={"all": (x, y)})
    if name == "SST2":
        return TransferData(splits={split: _parsed(root / "SST/binary" / f"sentiment-{split}", "utf-8", _sst_row)
                                    for split in ("train", "dev", "test")})
    if name == "TREC":
        return TransferData(splits={split: _parsed(root / "TREC" / fname, "latin-1", _trec_row)
                                    for split, fname in (("train", "train_5500.label"), ("test", "TREC_10.label"))})
    if name == "MRPC":
        return TransferData(splits={split: _parsed(root / "MRPC" / f"msr_paraphrase_{split}.txt", "utf-8", _mrpc_row,
                                                   skip=1) for split in ("train", "test")}, pairs=True)
    raise ValueError(f"unknown transfer task {name!r}; choose one of {TASKS}")


def _sst_row(line: str):
    """``text<SPACE><TAB>label`` (SentEval's SST binary files)."""
    text, label = line.strip().split("\t")
    return _join(text), int(label)


def _trec_row(line: str):
    """``COARSE:fine question``."""
    target, rest = line.strip().split(":", 1)
    if target not in TREC_CLASSES:
        raise ValueError(f"unknown TREC class {target!r}")
    return _join(rest.split(" ", 1)[1]), TREC_CLASSES.index(target)


def _mrpc_row(line: str):
    """``Quality<TAB>#1 ID<TAB>#2 ID<TAB>#1 String<TAB>#2 String`` (the MSR release's files)."""
    cols = line.strip().split("\t")
    return (_join(cols[3]), _join(cols[4])), int(cols[0])


_ROW_FORMATS = {_sst_row: "text<TAB>0|1", _trec_row: "COARSE:fine question",
                _mrpc_row: "5 tab-separated columns, Quality (0|1) first"}


def _parsed(path: Path, encoding: str, parse, skip: int = 0) -> tuple[list, np.ndarray]:
    """(texts, int64 labels) of the non-empty lines of ``path`` after ``skip`` header lines, each read by ``parse``;
    a line it cannot read is a ValueError naming the file, the line and the format expected."""
    x, y = [], []
    for n, line in enumerate(_read(path, encoding)[skip:], skip + 1):
        if not line.strip():
            continue
        try:
            text, label = parse(line)
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path} line {n}: expected {_ROW_FORMATS[parse]} as SentEval's copy has it (shared/data/"
                             f"MANIFEST.md §2); got {line[:80]!r} ({e})") from None
        x.append(text)
        y.append(label)
    return x, np.asarray(y, dtype=np.int64)


def pair_features(u_ND: np.ndarray, v_ND: np.ndarray, kind: str) -> np.ndarray:
    """MRPC features: [u, v, |u-v|, u*v] or SentEval's [|u-v|, u*v]."""
    if kind == "senteval":
        return np.concatenate([np.abs(u_ND - v_ND), u_ND * v_ND], axis=1)
    return np.concatenate([u_ND, v_ND, np.abs(u_ND - v_ND), u_ND * v_ND], axis=1)


def _fit_score(x_tr, y_tr, x_te, y_te, c: float, cfg: ClassifierConfig) -> float:
    clf = _fit(x_tr, y_tr, c, cfg)
    return float(clf.score(x_te, y_te))


def _fit(x_tr, y_tr, c: float, cfg: ClassifierConfig):
    """LogisticRegression fitted at C=c. scikit-learn's ConvergenceWarning (lbfgs stopping at max_iter, which
    SentEval's grid hits for most C on small embeddings) is kept off the console unless PRETRAIN_VERBOSE=1: it
    runs in every worker process, 69 times (~400 lines) for --suites transfer, and changes nothing reported."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression


    with warnings.catch_warnings():
        if not verbose():
            warnings.simplefilter("ignore", ConvergenceWarning)
        return LogisticRegression(C=c, max_iter=cfg.max_iter, random_state=cfg.seed).fit(x_tr, y_tr)


def select_c(x_NF: np.ndarray, y_N: np.ndarray, cfg: ClassifierConfig, folds: int,
             n_jobs: int = 1, grid: tuple[float, ...] | None = None) -> tuple[float, float]:
    """Best C of ``grid`` (default cfg.c_grid) by stratified k-fold accuracy: (C, its mean validation accuracy)."""
    from sklearn.model_selection import StratifiedKFold

    grid = cfg.c_grid if grid is None else grid
    skf = StratifiedKFold(n_splits=folds, shuffle=True, random_state=cfg.seed)
    splits = list(skf.split(x_NF, y_N))
    fits = _run_all([(_fit_score, (x_NF[tr], y_N[tr], x_NF[va], y_N[va], c, cfg))
                     for c in grid for tr, va in splits], n_jobs)
    return senteval_best(grid, [np.mean(fits[i * len(splits):(i + 1) * len(splits)]) for i in range(len(grid))])


def _outer_fold(x_tr, y_tr, x_te, y_te, cfg: ClassifierConfig) -> tuple[float, float]:
    """(test accuracy, inner validation accuracy) of one outer fold: C chosen on its training part."""
    c, dev = select_c(x_tr, y_tr, cfg, cfg.inner_kfold)
    return _fit_score(x_tr, y_tr, x_te, y_te, c, cfg), dev


def nested_cv_accuracy(x_NF: np.ndarray, y_N: np.ndarray, cfg: ClassifierConfig) -> dict:
    """SentEval's InnerKFoldClassifier: mean outer-fold test accuracy ×100, C chosen per outer fold (the outer
    folds run in parallel)."""
    from sklearn.model_selection import StratifiedKFold

    skf = StratifiedKFold(n_splits=cfg.kfold, shuffle=True, random_state=cfg.seed)
    folds = _run_all([(_outer_fold, (x_NF[tr], y_N[tr], x_NF[te], y_N[te], cfg))
                      for tr, te in skf.split(x_NF, y_N)], _jobs(cfg))
    accs, dev_accs = [a for a, _ in folds], [d for _, d in folds]
    return {"acc": 100 * float(np.mean(accs)), "devacc": 100 * float(np.mean(dev_accs)), "n": int(len(y_N))}


def train_test_accuracy(x_tr, y_tr, x_te, y_te, cfg: ClassifierConfig, x_dev=None, y_dev=None) -> dict:
    """C by dev accuracy over cfg.c_grid (when given) else k-fold CV on train over cfg.kfold_c_grid (SentEval's
    KFoldClassifier, cfg.inner_kfold folds: the model selection's, equal to cfg.kfold unless --inner-kfold says
    otherwise); refit on train; test accuracy ×100."""
    if x_dev is not None:
        scores = _run_all([(_fit_score, (x_tr, y_tr, x_dev, y_dev, c, cfg)) for c in cfg.c_grid], _jobs(cfg))
        c, dev = senteval_best(cfg.c_grid, scores)
    else:
        c, dev = select_c(x_tr, y_tr, cfg, cfg.inner_kfold, n_jobs=_jobs(cfg), grid=cfg.kfold_c_grid)
    clf = _fit(x_tr, y_tr, c, cfg)
    pred = clf.predict(x_te)
    out = {"acc": 100 * float(np.mean(pred == y_te)), "devacc": 100 * dev, "C": c, "n": int(len(y_te))}
    if len(np.unique(y_tr)) == 2:
        out["f1"] = 100 * binary_f1(pred, y_te)
    return out


def _embed(encode_fn: EncodeFn, sentences: list[str]) -> np.ndarray:
    uniq = sorted(set(sentences))
    emb = np.asarray(encode_fn(uniq), dtype=np.float64)
    index = {s: i for i, s in enumerate(uniq)}
    return emb[[index[s] for s in sentences]]


def evaluate_transfer_task(encode_fn: EncodeFn, data: TransferData, cfg: ClassifierConfig) -> dict:
    """Accuracy ×100 (and dev accuracy / chosen C) of one loaded task."""
    feats = {}
    for split, (x, y) in data.splits.items():
        if data.pairs:
            u, v = _embed(encode_fn, [a for a, _ in x]), _embed(encode_fn, [b for _, b in x])
            feats[split] = (pair_features(u, v, cfg.mrpc_features), y)
        else:
            feats[split] = (_embed(encode_fn, x), y)
    if cfg.backend == "pytorch":
        return evaluate_features(feats, cfg)
    if "all" in feats:
        return nested_cv_accuracy(*feats["all"], cfg)
    dev = feats.get("dev", (None, None))
    return train_test_accuracy(*feats["train"], *feats["test"], cfg, x_dev=dev[0], y_dev=dev[1])


PROTOCOL = {"MR": "nested {k}-fold CV", "CR": "nested {k}-fold CV", "SUBJ": "nested {k}-fold CV",
            "MPQA": "nested {k}-fold CV", "SST2": "C on dev, test", "TREC": "C by {k}-fold CV, test",
            "MRPC": "C by {k}-fold CV, test"}


def evaluate_transfer(encode_fn: EncodeFn, data_dir: str | Path, tasks=TASKS,
                      cfg: ClassifierConfig | None = None, log=None, results_path: str | Path | None = None,
                      resume_key: dict | None = None) -> dict:
    """{task: {acc, devacc, ...}, 'avg': mean test accuracy over the tasks}.

    With ``results_path``, each task's result is written there (atomically, JSON) as soon as it finishes, and a
    later call with the same ``resume_key`` (what identifies the model: path, pooling, ...) and classifier
    settings takes the finished tasks from it instead of running them again."""
    import time

    cfg = cfg or ClassifierConfig()
    say = log or (lambda _: None)
    key = transfer_resume_key(cfg, resume_key)
    done: dict = {}
    if results_path is not None and Path(results_path).is_file():
        try:
            saved = json.loads(Path(results_path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            say(f"[senteval] ignoring unreadable partial results {results_path} ({e})")
            saved = {}
        if saved.get("key") == key:
            done = {t: r for t, r in saved.get("tasks", {}).items() if t in tasks}
        elif saved:
            say(f"[senteval] {results_path} holds results of another model or classifier setting; starting over")
    out = {}
    for i, name in enumerate(tasks, 1):
        if name in done:
            out[name] = done[name]
            say(f"[senteval] {name} ({i}/{len(tasks)}): acc {out[name]['acc']:.2f} (resumed from {results_path})")
            continue
        t0 = time.perf_counter()
        data = load_transfer_task(data_dir, name)
        n = sum(len(y) for _, y in data.splits.values())
        say(f"[senteval] {name} ({i}/{len(tasks)}): {n:,} examples, "
            f"{PROTOCOL.get(name, '').format(k=cfg.kfold)} ({cfg.backend}), {_jobs(cfg)} process(es) ...")
        out[name] = evaluate_transfer_task(encode_fn, data, cfg)
        say(f"[senteval] {name}: acc {out[name]['acc']:.2f} ({time.perf_counter() - t0:.0f} s)")
        if results_path is not None:
            Path(results_path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(results_path, json.dumps({"key": key, "tasks": out}, indent=1))
    out["avg"] = float(np.mean([out[t]["acc"] for t in tasks]))
    return out


def transfer_resume_key(cfg: ClassifierConfig, resume_key: dict | None = None) -> dict:
    """What ``transfer_partial.json`` must match to be resumed: the model (``resume_key``) and the classifier's
    settings. The scikit-learn path's holds no 'backend', so files written before the PyTorch path existed stay
    valid."""
    classifier = cfg.settings()
    if cfg.backend == "sklearn":
        classifier.pop("backend")
    return {"model": json.loads(json.dumps(resume_key or {})), "classifier": classifier}


def transfer_markdown_table(rows: dict[str, dict]) -> str:
    """MR CR SUBJ MPQA SST-2 TREC MRPC Avg. (accuracy ×100), one line per model."""
    names = {"SST2": "SST-2"}
    lines = ["| Model | " + " | ".join(names.get(t, t) for t in TASKS) + " | Avg. |", "|" + "---|" * (len(TASKS) + 2)]
    for model, res in rows.items():
        cells = [f"{res[t]['acc']:.2f}" if t in res else "–" for t in TASKS]
        avg = f"{res['avg']:.2f}" if all(t in res for t in TASKS) else "–"
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {avg} |")
    return "\n".join(lines) + "\n"
