"""What the objective needs from outside the model and the batch, resolved by the trainer.

RankCSE's frozen teachers (opened from checkpoints) and SARCSE's token frequencies (from the training
data's stored ``token_freq.npy``, or counted over the sentence corpus). The loss composer
(``pretrain.objective``) receives them ready-made and never touches data or checkpoints itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from pretrain.config.data import DataConfig
from pretrain.config.objective import ObjectiveConfig
from pretrain.data.sentences import build_sentence_dataset
from pretrain.export.resolve import open_weights
from pretrain.objective.terms import Teachers


def load_teachers(cfg, *, trust: bool = False) -> Teachers:
    """``Teachers`` for objective.rank_distill (cfg: RankDistillConfig) with every teacher model loaded."""
    return Teachers(cfg, models=[load_teacher(p, trust=trust) for p in cfg.teachers])


def load_teacher(path: str, *, trust: bool = False):
    """A frozen teacher PretrainModel from anything ``open_weights`` recognises (our checkpoint, a from-hf
    init dir, a HF or sentence-transformers BERT dir)."""
    check_teacher_paths([path])
    return open_weights(path, trust=trust).build_model()


def check_teacher_paths(paths) -> None:
    """FileNotFoundError naming the first teacher path that does not exist (the trainer checks before loading)."""
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"objective.rank_distill teacher {path} does not exist; give one of our "
                                    "checkpoints, a pretrain-convert from-hf directory or a HF BERT directory")


def resolve_token_freq(cfg: ObjectiveConfig, data: DataConfig | None, tokenizer=None,
                       sentence_dataset=None) -> torch.Tensor:
    """SARCSE's freq(w): objective.reconstruction.token_freq, else the training data's frequencies (the
    sentence stage's dataset — ``sentence_dataset`` when the caller has it open, else opened here — stored
    or counted, or the first pretraining source's token_freq.npy)."""
    rc = cfg.reconstruction
    if rc.token_freq:
        return load_token_freq(rc.token_freq)
    if data is not None and data.stage == "sentences":
        if sentence_dataset is None:

            if tokenizer is None:
                raise ValueError("the sentence stage's token frequencies need the tokenizer")
            sentence_dataset = build_sentence_dataset(data, cfg, tokenizer, seed=0)
        return torch.from_numpy(sentence_dataset.token_frequencies())
    if data is not None and data.sources:
        return load_token_freq(data.sources[0].path)
    raise ValueError("objective.reconstruction needs token frequencies: set objective.reconstruction.token_freq "
                     "to a token_freq.npy (pretrain-preprocess writes one) or configure data.sources/data.sentences")


TOKEN_FREQ_FILE = "token_freq.npy"


def load_token_freq(path: str | Path, *, vocab_size: int | None = None) -> torch.Tensor:
    """token_freq.npy (float64 [V], >= 0, sums to 1) -> float64 tensor; a directory means <dir>/token_freq.npy."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKEN_FREQ_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"token frequency file {path} not found; run pretrain-preprocess on the training data "
            f"(it writes {TOKEN_FREQ_FILE}) or set objective.reconstruction.token_freq"
        )
    try:  # mapped: the header's shape is checked against the file's size before anything is allocated
        freq_V = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a whole .npy array ({e}); recompute it with pretrain-preprocess") from None
    if freq_V.ndim != 1 or not np.issubdtype(freq_V.dtype, np.floating):
        raise ValueError(f"{path}: expected a 1-D float array, got {freq_V.dtype} {freq_V.shape}")
    freq_V = np.array(freq_V, dtype=np.float64)
    if (freq_V < 0).any() or not np.isfinite(freq_V).all() or abs(float(freq_V.sum()) - 1.0) > 1e-6:
        raise ValueError(f"{path}: frequencies must be finite, >= 0 and sum to 1 (sum={float(freq_V.sum())})")
    if vocab_size is not None and freq_V.shape[0] != vocab_size:
        raise ValueError(f"{path}: {freq_V.shape[0]} entries but the vocabulary has {vocab_size}; "
                         "recompute it with the tokenizer used for training")
    return torch.from_numpy(freq_V)
