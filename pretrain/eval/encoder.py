"""Sentence encoder: turns a model + tokenizer into `encode_fn(sentences) -> np.ndarray [N, D]`.

The eval library only ever sees `encode_fn`. Sentences are tokenized once, sorted by length and
encoded in padded batches (little padding), under no_grad and eval mode; train mode is restored.

Legend: B batch, T tokens, D hidden size, N sentences.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from pretrain.console import show_progress
from pretrain.eval.hf_backend import HFBackbone, load_hf_backbone
from pretrain.export.recorded import recorded_pooling
from pretrain.export.resolve import detect_kind, open_weights
from pretrain.model.autoencoder import AUTOENCODER_Z, HEADS_FILE, ZEmbedding, autoencoder_from_state

EncodeFn = Callable[[list[str]], np.ndarray]
BACKENDS = ("auto", "pretrain", "transformers")


def tokenize_all(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids (no specials) per text; uses the tokenizer's batch call when it has one."""
    if hasattr(tokenizer, "encode_batch"):
        out = tokenizer.encode_batch(list(texts))
        return [o.ids if hasattr(o, "ids") else list(o) for o in out]
    return [list(tokenizer.encode(t)) for t in texts]


def add_specials(ids_a: list[int], ids_b: list[int] | None, tokenizer, max_len: int):
    """[CLS] a [SEP] (b [SEP]) cut to max_len (a pair by ``truncate_longest_first``); returns (ids, token_types). A
    RoBERTa vocabulary (``tokenizer.roberta_specials``): <s> a </s></s> b </s>, all type 0, as RoBERTa pairs them."""
    a, b = list(ids_a), list(ids_b) if ids_b is not None else None
    roberta = getattr(tokenizer, "roberta_specials", False)
    budget = max_len - (2 if b is None else 4 if roberta else 3)
    if b is None:
        a = a[:budget]
        return [tokenizer.cls_id, *a, tokenizer.sep_id], [0] * (len(a) + 2)
    a, b = truncate_longest_first(a, b, budget)
    if roberta:
        ids = [tokenizer.cls_id, *a, tokenizer.sep_id, tokenizer.sep_id, *b, tokenizer.sep_id]
        return ids, [0] * len(ids)
    ids = [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def truncate_longest_first(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """A pair cut to ``budget`` tokens as the tokenizers library's longest_first (transformers' fast tokenizers,
    run_glue): only the longer text loses tokens while the shorter fits in half the budget, else the shorter (``a``
    on a tie) keeps budget // 2 and the longer the rest (so a longer ``a`` keeps the odd token)."""
    if len(a) + len(b) <= budget:
        return a, b
    n_short = min(len(a), len(b), max(budget, 0) // 2)
    n_long = max(budget, 0) - n_short
    return (a[:n_short], b[:n_long]) if len(a) <= len(b) else (a[:n_long], b[:n_short])


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: (ids_BT, mask_BT)."""
    T = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BT[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask_BT[i, : len(s)] = 1
    return ids_BT, mask_BT


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Index batches over items sorted by decreasing length (stable)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def accepts_kwarg(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_encode(model, ids_BT, mask_BT, all_layers: bool = False, types_BT=None):
    """model.encode -> (h_BTD, layers or None); passes token types only if the model takes them."""
    kwargs = {"all_layers": all_layers} if all_layers else {}
    if types_BT is not None and accepts_kwarg(model.encode, "token_type_ids_BT"):
        kwargs["token_type_ids_BT"] = types_BT
    out = model.encode(ids_BT, mask_BT, **kwargs)
    if isinstance(out, tuple):
        return out[0], out[1]
    if isinstance(out, list):
        return out[-1], out
    return out, None


class SentenceEncoder:
    """encode_fn over our PretrainModel (or HFBackbone): length-sorted batches, pooled embeddings."""

    def __init__(self, model, tokenizer, *, pooling: str, max_len: int = 128, batch_size: int = 64,
                 device: str = "cpu", progress: bool = False):
        if max_len < 3:
            raise ValueError(f"max_len must be >= 3, got {max_len}")
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        self.max_len, self.batch_size, self.device, self.progress = max_len, batch_size, device, progress

    def __call__(self, sentences: list[str]) -> np.ndarray:
        """[N] sentences -> float32 [N, D] embeddings in input order."""
        if len(sentences) == 0:
            raise ValueError("encode_fn got no sentences")
        seqs = [add_specials(t, None, self.tokenizer, self.max_len)[0]
                for t in tokenize_all(self.tokenizer, sentences)]
        batches = length_sorted_batches([len(s) for s in seqs], self.batch_size)
        was_training = self.model.training
        self.model.eval()
        out: np.ndarray | None = None
        it = batches

        if show_progress(self.progress):  # a bar only on a terminal, never into a log file
            from tqdm import tqdm

            it = tqdm(batches, desc="encode", unit="batch", leave=False)
        try:
            with torch.no_grad():
                for idx in it:
                    ids_BT, mask_BT = pad_batch([seqs[i] for i in idx], self.tokenizer.pad_id)
                    ids_BT, mask_BT = ids_BT.to(self.device), mask_BT.to(self.device)
                    all_layers = self.pooling == "first_last_avg"
                    h_BTD, layers = run_encode(self.model, ids_BT, mask_BT, all_layers)
                    e_BD = self.model.pool(h_BTD, mask_BT, self.pooling, all_layers=layers)
                    e_BD = e_BD.float().cpu().numpy()
                    if out is None:
                        out = np.zeros((len(seqs), e_BD.shape[1]), dtype=np.float32)
                    out[idx] = e_BD
        finally:
            self.model.train(was_training)
        return out


def load_backbone(path: str | Path, backend: str = "auto", device: str = "cpu", *, trust: bool = False,
                  autoencoder_z: bool = False):
    """(model, tokenizer) from anything ``checkpoint.resolve.open_weights`` recognises.

    backend "pretrain"/"auto": our PretrainModel; "transformers": transformers.AutoModel, the reference
    path (HF dirs only). ``autoencoder_z``: the model wrapped to embed by SARCSE's Z (``ZEmbedding``), from the
    autoencoder a checkpoint or best/ of a run with objective.reconstruction keeps beside its weights.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist; pass a checkpoint or a HF model dir")
    if backend == "transformers":
        if autoencoder_z:
            raise ValueError(f"pooling {AUTOENCODER_Z} reads SARCSE's autoencoder from a checkpoint of ours (or its "
                             f"best/); a transformers model has none: use --backend pretrain")
        if detect_kind(p) not in ("hf", "sentence_transformers"):
            raise ValueError(f"{p} is not a HF model dir (no config.json); use backend 'pretrain'")
        model, tok = load_hf_backbone(p)
    else:
        w = open_weights(p, trust=trust)
        model, tok = w.build_model(warn_fresh_head=False), w.load_tokenizer()  # no MLM in evaluation or GLUE
        if autoencoder_z:
            ae = autoencoder_from_state(w.heads)
            if ae is None:
                raise ValueError(f"{p} holds no SARCSE autoencoder ({HEADS_FILE}); pooling {AUTOENCODER_Z} needs a "
                                 f"checkpoint (or best/) of a run with objective.reconstruction, written since "
                                 f"2026-12-07")
            if ae.text_cnns[0].in_channels != model.cfg.hidden_size:
                raise ValueError(f"{p}: its autoencoder reads {ae.text_cnns[0].in_channels}-dimensional token "
                                 f"states, the model makes {model.cfg.hidden_size}")
            model = ZEmbedding(model, ae)
    return model.to(device), tok


def max_tokens_of(backbone: torch.nn.Module) -> int | None:
    """The longest input the backbone's position table holds (ours: model.max_position less its offset;
    transformers': see HFBackbone.max_tokens); None when nothing limits it (rotary positions)."""
    if hasattr(backbone, "max_tokens"):
        return backbone.max_tokens
    return getattr(getattr(getattr(backbone, "encoder", None), "embeddings", None), "max_tokens", None)


def check_max_len(backbone: torch.nn.Module, max_len: int, flag: str) -> None:
    """ValueError naming ``flag`` when examples of ``max_len`` tokens would run past the backbone's positions
    (an index error deep in the model, a device-side assert on CUDA, only once such an example comes up)."""
    limit = max_tokens_of(backbone)
    if limit is not None and max_len > limit:
        raise ValueError(f"{flag} {max_len} is longer than the model's {limit} position embeddings (the most tokens "
                         f"it takes); pass {flag} {limit} or less")


DEFAULT_MAX_LEN = 128
"""Tokens per sentence, [CLS] and [SEP] included, when the model's position embeddings hold that many."""


def load_sentence_encoder(path: str | Path, pooling: str | None, *, backend: str = "auto",
                          max_len: int | None = DEFAULT_MAX_LEN, batch_size: int = 64, device: str = "cpu",
                          progress: bool = False, trust: bool = False) -> SentenceEncoder:
    """SentenceEncoder for a checkpoint / from-hf dir / HF BERT dir. A sentence-transformers directory's embedding
    is its modules' (Dense, Normalize; either backend) with ``pooling`` for its Pooling: warned when they differ.
    ``pooling`` None is ``pretrain-eval --pooling auto``'s (``recorded_pooling``: a run's evaluation pooling, its
    eval.pooling before model.pooling; a sentence-transformers directory's Pooling module; cls_before_pooler for a
    directory that states none; until 2026-12-08 a run's model.pooling, unlike the CLI's). ``max_len``
    None: DEFAULT_MAX_LEN, or the model's position embeddings where they hold fewer; one longer than they hold is a
    ValueError naming --max-len, before any sentence is encoded."""
    model, tok = load_backbone(path, backend=backend, device=device, trust=trust,
                               autoencoder_z=pooling == AUTOENCODER_Z)
    if isinstance(model, HFBackbone) and (Path(path) / "modules.json").is_file():
        model.read_sentence_modules(Path(path))  # ours reads them in load_backbone (open_weights)
        model.to(device)
    stated = getattr(model, "stated_pooling", None) or getattr(getattr(model, "cfg", None), "pooling", None)
    if pooling is None:
        pooling = recorded_pooling(path)[0] or stated or "cls_before_pooler"
    if stated is not None and stated != pooling and detect_kind(path) == "sentence_transformers":
        warnings.warn(f"{path} is a sentence-transformers model that pools by {stated} (its modules.json); pooling "
                      f"{pooling} gives other embeddings than sentence-transformers' (pass --pooling {stated} for "
                      f"those)", stacklevel=2)
    backbone = model.model if isinstance(model, ZEmbedding) else model
    if max_len is None:
        limit = max_tokens_of(backbone)
        max_len = DEFAULT_MAX_LEN if limit is None else min(DEFAULT_MAX_LEN, limit)
    check_max_len(backbone, max_len, "--max-len")
    return SentenceEncoder(model, tok, pooling=pooling, max_len=max_len, batch_size=batch_size,
                           device=device, progress=progress)
