"""GLUE tasks: published file formats, readers and official metrics (all 8 tasks + WNLI).

Files are the GLUE distribution's TSVs (`<data>/<Task>/{train,dev,test}.tsv`), read with quoting
disabled (GLUE text holds bare `"`). CoLA train/dev have no header; the rest are read by column name. Only the
labelled splits are read (train, dev*): GLUE's test files have no labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    name: str
    folder: str
    text_a: str | int
    """Column name (or index for header-less files) of the first sentence."""
    text_b: str | int | None
    label: str | int
    labels: tuple[str, ...] | None
    """Label strings in class order; None = regression (STS-B)."""
    metrics: tuple[str, ...]
    """Official metrics; their unweighted mean is the task's score (CLEAR Table 1 convention)."""
    dev_splits: tuple[str, ...] = ("dev",)
    header: bool = True
    small: bool = True
    """Small task: RoBERTa-style 10 epochs; large ones (MNLI, QNLI, QQP, SST-2) get fewer by default."""

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec(name="CoLA", folder="CoLA", text_a=3, text_b=None, label=1, labels=("0", "1"),
                     metrics=("mcc",), header=False),
    "sst2": TaskSpec(name="SST-2", folder="SST-2", text_a="sentence", text_b=None, label="label",
                     labels=("0", "1"), metrics=("acc",), small=False),
    "mrpc": TaskSpec(name="MRPC", folder="MRPC", text_a="#1 String", text_b="#2 String", label="Quality",
                     labels=("0", "1"), metrics=("f1", "acc")),
    "stsb": TaskSpec(name="STS-B", folder="STS-B", text_a="sentence1", text_b="sentence2", label="score",
                     labels=None, metrics=("pearson", "spearman")),
    "qqp": TaskSpec(name="QQP", folder="QQP", text_a="question1", text_b="question2", label="is_duplicate",
                    labels=("0", "1"), metrics=("f1", "acc"), small=False),
    "mnli": TaskSpec(name="MNLI", folder="MNLI", text_a="sentence1", text_b="sentence2", label="gold_label",
                     labels=("contradiction", "entailment", "neutral"), metrics=("acc",),
                     dev_splits=("dev_matched", "dev_mismatched"), small=False),
    "qnli": TaskSpec(name="QNLI", folder="QNLI", text_a="question", text_b="sentence", label="label",
                     labels=("entailment", "not_entailment"), metrics=("acc",), small=False),
    "rte": TaskSpec(name="RTE", folder="RTE", text_a="sentence1", text_b="sentence2", label="label",
                    labels=("entailment", "not_entailment"), metrics=("acc",)),
    "wnli": TaskSpec(name="WNLI", folder="WNLI", text_a="sentence1", text_b="sentence2", label="label",
                     labels=("0", "1"), metrics=("acc",)),
}
TABLE_ORDER = ("mnli", "qnli", "qqp", "rte", "sst2", "mrpc", "cola", "stsb")
"""Column order of CLEAR's Table 1."""


@dataclass(kw_only=True)
class GlueSplit:
    text_a: list[str]
    text_b: list[str] | None
    label: np.ndarray
    """int64 class ids, or float32 scores for regression."""

    def __len__(self) -> int:
        return len(self.text_a)


def get_task(name: str) -> TaskSpec:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[key]


class GlueFormatError(ValueError):
    """A GLUE file that cannot be read as its task's format (named with its path and line)."""


def split_path(task: TaskSpec, glue_dir: str | Path, split: str) -> Path:
    """``<glue_dir>/<folder>/<split>.tsv`` for a labelled split: "train" or one of ``task.dev_splits``. The test
    split has no labels (GLUE scores it on its server) and is refused, as is a dev split the task does not have."""
    if split not in ("train", *task.dev_splits):
        if split.startswith("test"):
            raise ValueError(f"{task.name} {split}: GLUE's test files have no labels (the GLUE server scores "
                             f"them); fine-tuning reads train and {', '.join(task.dev_splits)}")
        raise ValueError(f"{task.name} has no labelled split {split!r}; it has train, {', '.join(task.dev_splits)}")
    return Path(glue_dir) / task.folder / f"{split}.tsv"


def task_files(task: TaskSpec, glue_dir: str | Path) -> list[Path]:
    """Every file fine-tuning on ``task`` reads: train, then each dev split."""
    return [split_path(task, glue_dir, s) for s in ("train", *task.dev_splits)]


def _read_rows(path: Path) -> list[tuple[int, list[str]]]:
    """(1-based line number, tab-separated fields) per non-empty line; lines end at "\\n" (CRLF tolerated), so the
    numbers are those an editor shows."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; download GLUE and pass its root directory")
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    out = []
    for n, line in enumerate(lines, start=1):
        line = line[:-1] if line.endswith("\r") else line
        if line:
            out.append((n, line.split("\t")))
    return out


def read_split(task: TaskSpec, glue_dir: str | Path, split: str) -> GlueSplit:
    """Read `<glue_dir>/<folder>/<split>.tsv` for a labelled split (train / dev*). GlueFormatError naming the file
    and line for a row that does not fit the task's format."""
    path = split_path(task, glue_dir, split)
    rows = _read_rows(path)
    if not rows:
        raise GlueFormatError(f"{path} is empty")
    if task.header:
        (_, header), rows = rows[0], rows[1:]

        def col(key):
            if key not in header:
                raise GlueFormatError(f"{path}: column {key!r} missing from header {header}")
            # MNLI's gold_label is the last column; index from the right when the header is wider
            i = header.index(key)
            return i if key != "gold_label" else i - len(header)
    else:
        def col(key):
            return key

    ia, il = col(task.text_a), col(task.label)
    ib = col(task.text_b) if task.text_b is not None else None
    need = max(abs(i) + (0 if i < 0 else 1) for i in (ia, il, ib) if i is not None)
    a, b, y = [], [], []
    for line, r in rows:
        if len(r) < need:
            raise GlueFormatError(f"{path}, line {line}: {len(r)} columns, expected >= {need}")
        lab = r[il].strip()
        if task.labels is not None and lab not in task.labels:
            if task.name == "MNLI" and lab == "-":  # unlabelled pairs exist in some MNLI copies
                continue
            raise GlueFormatError(f"{path}, line {line}: label {lab!r} not in {task.labels}")
        if task.labels is None:
            try:
                score = float(lab)
            except ValueError:
                score = math.nan
            if not math.isfinite(score):
                raise GlueFormatError(f"{path}, line {line}: score {lab!r} is not a number")
        a.append(r[ia])
        if ib is not None:
            b.append(r[ib])
        y.append(score if task.labels is None else task.labels.index(lab))
    label = np.asarray(y, dtype=np.float32 if task.labels is None else np.int64)
    return GlueSplit(text_a=a, text_b=b if ib is not None else None, label=label)


def matthews_corr(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    tp = float(np.sum((y_true == 1) & (y_pred == 1)))
    tn = float(np.sum((y_true == 0) & (y_pred == 0)))
    fp = float(np.sum((y_true == 0) & (y_pred == 1)))
    fn = float(np.sum((y_true == 1) & (y_pred == 0)))
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else (tp * tn - fp * fn) / denom


def f1_binary(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    tp = float(np.sum((y_true == 1) & (y_pred == 1)))
    fp = float(np.sum((y_true == 0) & (y_pred == 1)))
    fn = float(np.sum((y_true == 1) & (y_pred == 0)))
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def rank_score(score: float) -> float:
    """A score to choose the best by: NaN (the correlation of constant predictions, as STS-B's head gives early in
    training) ranks below every number, instead of comparing False with all of them."""
    return -math.inf if math.isnan(score) else score


def compute_metrics(task: TaskSpec, pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """Official metrics ×100 plus `score` (their mean). pred: class ids, or scores for STS-B."""
    out = {}
    for m in task.metrics:
        if m == "acc":
            out[m] = float(np.mean(pred == label))
        elif m == "f1":
            out[m] = f1_binary(label, pred)
        elif m == "mcc":
            out[m] = matthews_corr(label, pred)
        elif m == "pearson":
            out[m] = float(pearsonr(pred, label)[0])
        elif m == "spearman":
            out[m] = float(spearmanr(pred, label)[0])
    out = {k: 100.0 * v for k, v in out.items()}
    out["score"] = float(np.mean([out[m] for m in task.metrics]))
    return out
