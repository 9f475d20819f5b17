"""The transfer tasks' classifier settings (SentEval's scikit-learn path and its PyTorch one, ``TRANSFER_CLASSIFIERS``),
SentEval's pick of the regularisation on rounded accuracies (``senteval_best``) and the fits' process pool: what
``senteval`` (task loading, the scikit-learn procedures) and ``senteval_torch`` (the PyTorch procedures) share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

@dataclass(kw_only=True)
class TorchClassifierConfig:
    """SentEval's PyTorch classifier (``usepytorch=True``, nhid 0): a linear layer trained by mini-batch ``optim``
    with early stopping on a dev split. Defaults: SimCSE's evaluation.py mode 'test'."""

    optim: str = "adam"
    """'adam' or 'rmsprop', each at torch's defaults (Adam lr 1e-3; RMSprop lr 1e-2, alpha 0.99)."""
    batch_size: int = 64
    tenacity: int = 5
    """Dev evaluations without improvement tolerated before stopping, counted over the whole fit (never reset)."""
    epoch_size: int = 4
    """Epochs between two dev evaluations."""
    max_epoch: int = 200
    """No new round of ``epoch_size`` epochs starts once this many have run."""
    l2_grid: tuple[float, ...] = tuple(10**t for t in range(-5, -1))
    """Coupled L2 (the optimizer's weight_decay) tried by every selection: SentEval's 1e-5 … 1e-2."""
    validation_split: float = 0.05
    """Share of the training rows a final fit without a dev set holds out for its early stopping."""

    def __post_init__(self) -> None:
        if self.optim not in ("adam", "rmsprop"):
            raise ValueError(f"pytorch.optim must be 'adam' or 'rmsprop', got {self.optim!r}")
        if self.batch_size < 1 or self.epoch_size < 1 or self.tenacity < 0 or self.max_epoch < 0:
            raise ValueError(f"pytorch: batch_size and epoch_size must be >= 1, tenacity and max_epoch >= 0; got "
                             f"{self.batch_size}, {self.epoch_size}, {self.tenacity}, {self.max_epoch}")
        if not self.l2_grid or min(self.l2_grid) < 0:
            raise ValueError(f"pytorch.l2_grid must be non-empty and >= 0, got {self.l2_grid}")
        if not 0 < self.validation_split < 1:
            raise ValueError(f"pytorch.validation_split must be in (0, 1), got {self.validation_split}")


@dataclass(kw_only=True)
class ClassifierConfig:
    backend: str = "sklearn"
    """'sklearn': SentEval's scikit-learn path (LogisticRegression over c_grid / kfold_c_grid); 'pytorch': its
    PyTorch path with the ``pytorch`` settings (what SimCSE's, ArcCSE's and RankCSE's transfer tables used)."""
    pytorch: TorchClassifierConfig = field(default_factory=TorchClassifierConfig)
    """The PyTorch classifier's settings (backend 'pytorch' only)."""
    c_grid: tuple[float, ...] = tuple(2.0**t for t in range(-2, 4))
    """Inverse L2 strengths tried by nested CV and dev selection (SentEval's InnerKFold/Split grid 2^-2 … 2^3)."""
    kfold_c_grid: tuple[float, ...] = tuple(2.0**t for t in range(-1, 6))
    """Inverse L2 strengths tried when C is chosen by k-fold CV on train (TREC, MRPC): SentEval's KFoldClassifier
    grid 2^-1 … 2^5."""
    kfold: int = 10
    inner_kfold: int = 0
    """Folds of the model selection: the inner folds of the InnerKFold tasks and the CV on train of the KFold tasks
    (TREC, MRPC); 0 = kfold, as SentEval (fewer is faster)."""
    seed: int = 1111
    max_iter: int = 100
    """lbfgs iterations: SentEval's sklearn path builds ``LogisticRegression(C, random_state)``, i.e. scikit-learn's
    default 100 (200 until 2026-12-07)."""
    mrpc_features: str = "senteval"
    """'senteval' = [|u-v|, u*v] as in SentEval's mrpc.py (what the SimCSE-family papers' transfer tables use; the
    default since 2026-12-06, before it the other); 'uv_absdiff_prod' = [u, v, |u-v|, u*v]."""
    n_jobs: int = 0
    """Processes for the independent fits (folds x C); 0 = every core this process may use. The result does not
    depend on it: each fit is the same deterministic problem wherever it runs."""

    def __post_init__(self) -> None:
        self.inner_kfold = self.inner_kfold or self.kfold
        if self.kfold < 2 or self.inner_kfold < 2:
            raise ValueError(f"kfold and inner_kfold must be >= 2, got {self.kfold}, {self.inner_kfold}")
        if self.n_jobs < 0:
            raise ValueError(f"n_jobs must be >= 0 (0 = all cores), got {self.n_jobs}")
        if self.mrpc_features not in ("uv_absdiff_prod", "senteval"):
            raise ValueError(f"mrpc_features must be 'uv_absdiff_prod' or 'senteval', got {self.mrpc_features!r}")
        if self.backend not in ("sklearn", "pytorch"):
            raise ValueError(f"backend must be 'sklearn' or 'pytorch', got {self.backend!r}")

    def settings(self) -> dict:
        """The settings that decide the figures, as JSON reads them back (the transfer resume key, eval.json's
        record): never n_jobs, and only the running backend's own."""
        import dataclasses

        other = ("pytorch",) if self.backend == "sklearn" else ("c_grid", "kfold_c_grid", "max_iter")
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("n_jobs", *other)}
        return json.loads(json.dumps(out))  # tuples -> lists

    def describe(self) -> str:
        """One line naming the classifier, for logs and eval.md."""
        folds = f"{self.kfold}-fold (inner {self.inner_kfold})"
        if self.backend == "sklearn":
            return f"SentEval's scikit-learn path: LogisticRegression (lbfgs, max_iter {self.max_iter}), {folds}"
        t = self.pytorch
        return (f"SentEval's PyTorch path: linear layer, {t.optim}, batch {t.batch_size}, tenacity {t.tenacity}, "
                f"epoch_size {t.epoch_size}, L2 {min(t.l2_grid):g}…{max(t.l2_grid):g}, {folds}")


TRANSFER_CLASSIFIERS = {
    "sklearn": {},
    "pytorch-test": {"backend": "pytorch", "kfold": 10, "pytorch": {}},
    "pytorch-fasttest": {"backend": "pytorch", "kfold": 5,
                         "pytorch": {"optim": "rmsprop", "batch_size": 32, "tenacity": 3, "epoch_size": 2}},
}
"""``--transfer-classifier``: today's scikit-learn path, or SimCSE's evaluation.py modes 'test' / 'fasttest'."""


def transfer_classifier(name: str, *, inner_kfold: int | None = None, **kw) -> ClassifierConfig:
    """The ClassifierConfig of a TRANSFER_CLASSIFIERS entry; ``inner_kfold`` defaults to its kfold (SentEval's)."""
    if name not in TRANSFER_CLASSIFIERS:
        raise ValueError(f"unknown transfer classifier {name!r}; choose one of {tuple(TRANSFER_CLASSIFIERS)}")
    preset = dict(TRANSFER_CLASSIFIERS[name])
    if "pytorch" in preset:
        preset["pytorch"] = TorchClassifierConfig(**preset["pytorch"])
    kfold = preset.get("kfold", ClassifierConfig.kfold)
    return ClassifierConfig(**preset, inner_kfold=kfold if inner_kfold is None else inner_kfold, **kw)


def _jobs(cfg: ClassifierConfig) -> int:
    import os

    return cfg.n_jobs or len(os.sched_getaffinity(0))


def _run_all(calls: list, n_jobs: int) -> list:
    """[fn(*args) for fn, args in calls], in worker processes when n_jobs > 1 (joblib limits each worker's BLAS
    threads so that the cores are not oversubscribed); results in input order."""
    if n_jobs <= 1 or len(calls) <= 1:
        return [fn(*args) for fn, args in calls]
    from joblib import Parallel, delayed

    return Parallel(n_jobs=min(n_jobs, len(calls)))(delayed(fn)(*args) for fn, args in calls)


def senteval_best(grid: tuple[float, ...], accs) -> tuple[float, float]:
    """SentEval's pick of C (tools/validation.py): the first C of the best accuracy ×100 rounded to 2 decimals, so a
    near-tie (fold sizes differ by one) goes to the smaller C as there; (C, that accuracy as a fraction). Each value
    is rounded as its type rounds, as there: a fold mean (numpy float64) by numpy, one accuracy (float) by Python."""
    pct = [round(100 * a, 2) for a in accs]
    best = int(np.argmax(pct))
    return grid[best], float(pct[best]) / 100


def binary_f1(pred_N, y_N) -> float:
    """F1 of label 1 (SentEval's MRPC figure, scikit-learn's f1_score), as a fraction: 2 tp / (2 tp + fp + fn)."""
    tp = int(np.sum((np.asarray(pred_N) == 1) & (np.asarray(y_N) == 1)))
    return 2 * tp / max(1, 2 * tp + int(np.sum(np.asarray(pred_N) != np.asarray(y_N))))
