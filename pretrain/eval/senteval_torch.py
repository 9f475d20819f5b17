"""SentEval's PyTorch classifier path (``usepytorch=True``), the one behind the SimCSE, ArcCSE and RankCSE transfer
tables: a linear layer (nhid 0) trained by mini-batch Adam/RMSprop with early stopping on a dev split, and SentEval's
three model selections over the L2 grid (tools/classifier.py, tools/validation.py):

- InnerKFold (MR, CR, SUBJ, MPQA): outer stratified k folds; on each outer training part the L2 strength with the best
  inner k-fold accuracy (each inner fit stopping early on its inner test fold), a refit on the part holding out 5 %
  for its early stopping, its accuracy on the outer fold; dev / test = the fold means rounded to 2 decimals.
- KFold (TREC, MRPC): L2 by k-fold accuracy on train, refit on train holding out 5 %, test accuracy.
- Split (SST-2): L2 by dev accuracy (each fit stopping early on dev), test accuracy of that fit.

Written from the description of SentEval's code, not from it. Every fit re-seeds (numpy's permutations, the layer's
initialisation) as each SentEval classifier object does, and runs on one thread: a fit gives the same numbers in any
process, so ``n_jobs`` changes nothing but the time.

Legend: N examples, F features, C classes.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import torch

from pretrain.eval.transfer_setup import (
    ClassifierConfig,
    TorchClassifierConfig,
    _jobs,
    _run_all,
    binary_f1,
    senteval_best,
)

OPTIMIZERS = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}


def _floats(x) -> torch.Tensor:
    """float32 rows as SentEval feeds its classifier (a copy: a memory-mapped array from a worker is read-only)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, dtype=np.float32))


def _labels(y) -> torch.Tensor:
    return y if isinstance(y, torch.Tensor) else torch.from_numpy(np.array(y, dtype=np.int64))


class LogReg:
    """SentEval's PyTorchClassifier with nhid 0: ``nn.Linear(F, C)`` on float32 features, ``nn.CrossEntropyLoss()``,
    ``cfg.optim`` at torch's defaults with ``weight_decay = l2reg`` (coupled L2). Built as SentEval builds one: the
    layer right after seeding numpy and torch with ``seed`` (here a private RandomState and a forked torch RNG: the
    same numbers, the process's generators untouched).

    The loss is the batch mean. SentEval sets ``loss_fn.size_average = False`` after building the loss, which torch
    >= 1.0 (the versions SimCSE ran) ignores, so the mean is what those runs optimised."""

    def __init__(self, num_features: int, num_classes: int, l2reg: float, cfg: TorchClassifierConfig,
                 seed: int = 1111):
        self.cfg = cfg
        self.rng = np.random.RandomState(seed)  # = np.random.seed(seed) then np.random.permutation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = torch.nn.Linear(num_features, num_classes)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.optimizer = OPTIMIZERS[cfg.optim](self.model.parameters())
        self.optimizer.param_groups[0]["weight_decay"] = l2reg
        self.nepoch = 0

    def fit(self, x_NF, y_N, validation_data=None, validation_split: float | None = None) -> float:
        """Rounds of ``epoch_size`` epochs, each followed by the dev accuracy, while ``nepoch <= max_epoch``; a round
        that does not beat the best stops the fit when ``tenacity`` rounds already failed (checked before counting
        it; the count is never reset). The best round's model is kept. -> its dev accuracy (fraction)."""
        x_tr, y_tr, x_dev, y_dev = self._split(x_NF, y_N, validation_data, validation_split)
        self.nepoch, best, best_state, misses, stop = 0, -1.0, None, 0, False
        while not stop and self.nepoch <= self.cfg.max_epoch:
            self.train_epochs(x_tr, y_tr)
            acc = self.dev_accuracy(x_dev, y_dev)
            if acc > best:
                best, best_state = acc, copy.deepcopy(self.model.state_dict())
            else:
                if misses >= self.cfg.tenacity:
                    stop = True
                misses += 1
        self.model.load_state_dict(best_state)
        return best

    def _split(self, x_NF, y_N, validation_data, validation_split):
        """(train x, y, dev x, y): the given dev set, or the first ``int(split * N)`` rows of a permutation."""
        x, y = _floats(x_NF), _labels(y_N)
        if validation_data is not None:
            return x, y, _floats(validation_data[0]), _labels(validation_data[1])
        assert validation_split is not None, "fit needs validation_data or validation_split"
        perm = torch.from_numpy(self.rng.permutation(len(x)))
        num_dev = int(validation_split * len(x))
        if num_dev == 0:
            raise ValueError(f"validation_split {validation_split} of {len(x)} rows leaves no dev row")
        return x[perm[num_dev:]], y[perm[num_dev:]], x[perm[:num_dev]], y[perm[:num_dev]]

    def train_epochs(self, x_NF: torch.Tensor, y_N: torch.Tensor) -> None:
        """``epoch_size`` epochs, each in mini-batches of ``batch_size`` over a fresh permutation."""
        self.model.train()
        bs = self.cfg.batch_size
        for _ in range(self.cfg.epoch_size):
            perm = torch.from_numpy(self.rng.permutation(len(x_NF)))
            for i in range(0, len(perm), bs):
                idx = perm[i:i + bs]
                loss = self.loss_fn(self.model(x_NF[idx]), y_N[idx])
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
        self.nepoch += self.cfg.epoch_size

    def dev_accuracy(self, x_NF, y_N) -> float:
        """The accuracy early stopping reads after each round (a hook: tests script it)."""
        return self.score(x_NF, y_N)

    @torch.no_grad()
    def predict(self, x_NF) -> np.ndarray:
        """argmax of the logits, in batches of ``batch_size`` as SentEval scores."""
        self.model.eval()
        x, bs = _floats(x_NF), self.cfg.batch_size
        return torch.cat([self.model(x[i:i + bs]).max(1)[1] for i in range(0, len(x), bs)]).numpy()

    def score(self, x_NF, y_N) -> float:
        return _accuracy(self.predict(x_NF), y_N)


def _accuracy(pred_N, y_N) -> float:
    """correct / N as a Python float (SentEval's ``1.0 * correct / len``, rounded the way Python rounds)."""
    return int(np.sum(np.asarray(pred_N) == np.asarray(y_N))) / len(y_N)


@contextmanager
def _one_thread():
    """One intra-op thread for the fit: the numbers then do not depend on the cores a worker gets."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fold_score(x_NF, y_N, fit_rows, dev_rows, l2reg: float, num_classes: int, cfg: ClassifierConfig) -> float:
    """One grid-search fit: trained on ``fit_rows``, stopped early on ``dev_rows``; its accuracy there."""
    with _one_thread():
        clf = LogReg(x_NF.shape[1], num_classes, l2reg, cfg.pytorch, cfg.seed)
        dev = (x_NF[dev_rows], y_N[dev_rows])
        clf.fit(x_NF[fit_rows], y_N[fit_rows], validation_data=dev)
        return clf.score(*dev)


def _final_predict(x_NF, y_N, l2reg: float, num_classes: int, cfg: ClassifierConfig, x_test, dev=None):
    """Predictions on ``x_test`` of a fit on all rows stopped early on ``dev`` or else on ``validation_split`` of
    them; with ``dev``, (its dev accuracy, the predictions)."""
    with _one_thread():
        clf = LogReg(x_NF.shape[1], num_classes, l2reg, cfg.pytorch, cfg.seed)
        clf.fit(x_NF, y_N, validation_data=dev,
                validation_split=cfg.pytorch.validation_split if dev is None else None)
        pred = clf.predict(x_test)
        return pred if dev is None else (clf.score(*dev), pred)


def _grid_means(x_NF, y_N, splits: list, num_classes: int, cfg: ClassifierConfig, n_jobs: int) -> list:
    """Mean fold accuracy (numpy float64, as SentEval's ``np.mean``) per L2 strength over ``splits``."""
    grid, k = cfg.pytorch.l2_grid, len(splits)
    accs = _run_all([(_fold_score, (x_NF, y_N, tr, va, reg, num_classes, cfg)) for reg in grid for tr, va in splits],
                    n_jobs)
    return [np.mean(accs[i * k:(i + 1) * k]) for i in range(len(grid))]


def _stratified(folds: int, cfg: ClassifierConfig, x_NF, y_N) -> list:
    from sklearn.model_selection import StratifiedKFold

    return list(StratifiedKFold(n_splits=folds, shuffle=True, random_state=cfg.seed).split(x_NF, y_N))


def _outer_fold(x_NF, y_N, tr, te, num_classes: int, cfg: ClassifierConfig) -> tuple[float, float]:
    """(dev %, test %) of one outer fold: L2 by inner k-fold on its training part, refit, test on the fold."""
    x_tr, y_tr = x_NF[tr], y_N[tr]
    means = _grid_means(x_tr, y_tr, _stratified(cfg.inner_kfold, cfg, x_tr, y_tr), num_classes, cfg, 1)
    reg, dev = senteval_best(cfg.pytorch.l2_grid, means)
    pred = _final_predict(x_tr, y_tr, reg, num_classes, cfg, x_NF[te])
    return round(100 * dev, 2), round(100 * _accuracy(pred, y_N[te]), 2)


def inner_kfold_accuracy(x_NF, y_N, cfg: ClassifierConfig, num_classes: int) -> dict:
    """SentEval's InnerKFoldClassifier (MR, CR, SUBJ, MPQA); the outer folds run in parallel."""
    folds = _run_all([(_outer_fold, (x_NF, y_N, tr, te, num_classes, cfg))
                      for tr, te in _stratified(cfg.kfold, cfg, x_NF, y_N)], _jobs(cfg))
    return {"acc": float(round(np.mean([t for _, t in folds]), 2)),
            "devacc": float(round(np.mean([d for d, _ in folds]), 2)), "n": int(len(y_N))}


def _test_result(pred_N, y_N, reg: float, dev: float, num_classes: int) -> dict:
    """acc / devacc ×100 rounded to 2 decimals as SentEval reports them; binary tasks also F1 of label 1 (SentEval's
    MRPC: sklearn's f1_score)."""
    out = {"acc": round(100 * _accuracy(pred_N, y_N), 2), "devacc": round(100 * dev, 2), "l2reg": reg,
           "n": int(len(y_N))}
    if num_classes == 2:
        out["f1"] = round(100 * binary_f1(pred_N, y_N), 2)
    return out


def num_classes_of(*labels) -> int:
    """Largest label + 1 over the given label arrays (SentEval's nclasses for these tasks)."""
    return int(max(np.max(y) for y in labels)) + 1


def kfold_accuracy(x_tr, y_tr, x_te, y_te, cfg: ClassifierConfig, num_classes: int) -> dict:
    """SentEval's KFoldClassifier (TREC, MRPC): L2 by k-fold on train (fits in parallel), refit with 5 % held out,
    test accuracy."""
    means = _grid_means(x_tr, y_tr, _stratified(cfg.inner_kfold, cfg, x_tr, y_tr), num_classes, cfg, _jobs(cfg))
    reg, dev = senteval_best(cfg.pytorch.l2_grid, means)
    return _test_result(_final_predict(x_tr, y_tr, reg, num_classes, cfg, x_te), y_te, reg, dev, num_classes)


def split_accuracy(x_tr, y_tr, x_dev, y_dev, x_te, y_te, cfg: ClassifierConfig, num_classes: int) -> dict:
    """SentEval's SplitClassifier (SST-2): L2 by dev accuracy (one fit per strength, in parallel), test accuracy.
    SentEval refits at the chosen strength; that fit starts from the same seed on the same rows, so it is the grid's
    fit, whose test predictions are taken instead."""
    grid = cfg.pytorch.l2_grid
    fits = _run_all([(_final_predict, (x_tr, y_tr, reg, num_classes, cfg, x_te, (x_dev, y_dev))) for reg in grid],
                    _jobs(cfg))
    reg, dev = senteval_best(grid, [acc for acc, _ in fits])
    return _test_result(fits[grid.index(reg)][1], y_te, reg, dev, num_classes)


def evaluate_features(feats: dict, cfg: ClassifierConfig) -> dict:
    """One task's result from its features {split: (x_NF, y_N)}: 'all' -> InnerKFold, a 'dev' split -> Split,
    else KFold; classes = largest label + 1. Features as float32, SentEval's: from float32 embeddings, MRPC's
    [|u-v|, u*v] made in float64 and rounded are the float32 results (the difference and product are exact there)."""
    feats = {s: (np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)) for s, (x, y) in feats.items()}
    num_classes = num_classes_of(*(y for _, y in feats.values()))
    if "all" in feats:
        return inner_kfold_accuracy(*feats["all"], cfg, num_classes)
    if "dev" in feats:
        return split_accuracy(*feats["train"], *feats["dev"], *feats["test"], cfg, num_classes)
    return kfold_accuracy(*feats["train"], *feats["test"], cfg, num_classes)
