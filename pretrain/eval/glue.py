"""GLUE fine-tuning: the head of transformers' *ForSequenceClassification, AdamW, 6% linear warmup (RoBERTa's).

The head: a BERT backbone with a pooler (ours as to-hf writes a BertModel, transformers' BertModel) gets BERT's,
pooler(h_cls) = tanh(W h_cls + b) -> dropout -> Linear; a ModernBERT (ours at model.arch=modernbert, transformers'
ModernBertModel) gets ModernBertForSequenceClassification's, cls or mean pooling -> dense -> activation -> LayerNorm
-> dropout -> Linear; any other (RoBERTa, pre-LN, none) gets RoBERTa's, dropout -> dense -> tanh -> dropout -> Linear
on [CLS]. Updates follow transformers' Trainer: linear
schedule (get_linear_schedule_with_warmup, ceil(warmup_ratio * updates) warm-up), global gradient norm clipped to
1.0, no decay on biases and norms; the other defaults are RoBERTa's (betas 0.9/0.98, eps 1e-6, decay 0.1, 10 epochs
on small tasks). One call of `finetune` = one (task, lr, seed) run; it evaluates on the dev split(s) after every
epoch (or every `eval_every` steps) and keeps the best dev score (run_glue reports the last). Sweeps live in glue_cli.

Legend: B batch, T tokens, D hidden size, C classes (1 for regression).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from pretrain.checkpoint.files import save_safetensors
from pretrain.eval.encoder import add_specials, pad_batch, run_encode, tokenize_all
from pretrain.eval.glue_data import (
    GlueSplit,
    TaskSpec,
    compute_metrics,
    get_task,
    rank_score,
    read_split,
)
from pretrain.export.hf_modern import ACT_TO_HF

BEST_WEIGHTS = "best_model.safetensors"
"""``finetune``'s ``save_dir``: the best dev state of the backbone and its classifier head (``GlueModel``'s names)."""


@dataclass(kw_only=True)
class FinetuneConfig:
    task: str
    lr: float = 2e-5
    batch_size: int = 32
    epochs: int = 10
    warmup_ratio: float = 0.06
    """Fraction of all updates spent in linear warmup, rounded up as Trainer does (RoBERTa: 6%; run_glue: 0; BERT's
    paper: 10%)."""
    weight_decay: float = 0.1
    """AdamW decay on all but biases and norms (RoBERTa: 0.1; Trainer/run_glue: 0; BERT: 0.01)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """RoBERTa's; Trainer's and BERT's are (0.9, 0.999)."""
    eps: float = 1e-6
    """RoBERTa's; Trainer's 1e-8, BERT's 1e-6."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each update (Trainer's max_grad_norm, BERT's 1.0); 0 = off
    (RoBERTa's fairseq recipe: --clip-norm 0)."""
    dropout: float | None = None
    """The classifier's dropout; None = the head's own: 0.1 for BERT's and RoBERTa's (hidden_dropout_prob),
    ModernBERT's classifier_dropout (transformers' default 0.0, which ours at model.arch=modernbert takes)."""
    max_len: int = 128
    seed: int = 1
    eval_every: int = 0
    """Evaluate every N updates; 0 = at the end of every epoch."""
    max_train_examples: int = 0
    """Use only the first N (shuffled with the seed) training examples; 0 = all."""
    eval_batch_size: int = 128
    device: str = "cpu"
    bf16: bool = False
    """Autocast to bfloat16 (CUDA)."""

    def __post_init__(self) -> None:
        get_task(self.task)
        for name in ("lr", "batch_size", "epochs", "eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"finetune.{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "max_train_examples"):
            if getattr(self, name) < 0:
                zero = "every epoch" if name == "eval_every" else "all"
                raise ValueError(f"finetune.{name} must be >= 0 (0 = {zero}), got {getattr(self, name)}")
        if self.max_len < 4:  # [CLS] a [SEP] b [SEP] needs 3 special tokens, RoBERTa's <s> a </s></s> b </s> 4
            raise ValueError(f"finetune.max_len must be >= 4 (a pair's special tokens), got {self.max_len}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"finetune.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_grad_norm < 0:
            raise ValueError(f"finetune.max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"finetune.dropout must be in [0, 1) (or None: the head's own), got {self.dropout}")


class GlueHead(nn.Module):
    """RoBERTa's (RobertaClassificationHead): dropout -> dense -> tanh -> dropout -> out on the [CLS] state; with
    ``dense=False`` BERT's after its pooler: dropout -> out. h_BD -> logits_BC; weights N(0, 0.02), biases 0."""

    def __init__(self, hidden: int, num_labels: int, dropout: float, generator: torch.Generator, dense: bool = True):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden) if dense else None
        self.out = nn.Linear(hidden, num_labels)
        self.drop = nn.Dropout(dropout)
        for lin in (self.dense, self.out):
            if lin is not None:
                with torch.no_grad():
                    lin.weight.normal_(0.0, 0.02, generator=generator)
                    lin.bias.zero_()

    def forward(self, h_BD: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            h_BD = torch.tanh(self.dense(self.drop(h_BD)))
        return self.out(self.drop(h_BD))


@dataclass(kw_only=True)
class ModernHeadSpec:
    """ModernBertForSequenceClassification's head as a ModernBertConfig states it (its field names in brackets)."""

    pooling: str
    """[classifier_pooling] "cls": the first token's state; "mean": the mean over the attention mask."""
    bias: bool
    """[classifier_bias] of the head's dense."""
    activation: nn.Module
    """[classifier_activation] after the dense."""
    norm_eps: float
    """[norm_eps] of the LayerNorm after the activation."""
    norm_bias: bool
    """[norm_bias] of that LayerNorm."""
    dropout: float
    """[classifier_dropout] before the final Linear."""
    dense_std: float
    """_init_weights' "out" std of the dense: initializer_range / sqrt(2 num_hidden_layers)."""
    cutoff: float
    """[initializer_cutoff_factor]: weights are drawn truncated at +-cutoff stds."""


def _activation(name: str) -> nn.Module:
    """transformers' activation module of that name (ACT2FN; imported only for a ModernBERT)."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def modernbert_head_of(backbone: nn.Module) -> ModernHeadSpec | None:
    """The ModernBERT head's settings: transformers' ModernBertModel from its config; ours at model.arch=modernbert
    from what to-hf writes (activation, layer_norm_eps as norm_eps, init_std as initializer_range, no biases) and
    transformers' defaults for what our config lacks (classifier_pooling "cls", classifier_dropout 0.0,
    initializer_cutoff_factor 2.0). None for any other backbone."""
    hf = getattr(backbone, "hf", None)
    if hf is not None:
        c = hf.config
        if getattr(c, "model_type", None) != "modernbert":
            return None
        cutoff = getattr(c, "initializer_cutoff_factor", None)
        return ModernHeadSpec(pooling=c.classifier_pooling, bias=c.classifier_bias,
                              activation=_activation(c.classifier_activation), norm_eps=c.norm_eps,
                              norm_bias=c.norm_bias,
                              dropout=float(c.classifier_dropout),
                              dense_std=c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers),
                              cutoff=3.0 if cutoff is None else float(cutoff))  # _init_weights' fallback
    cfg = getattr(backbone, "cfg", None)
    if getattr(cfg, "arch", None) != "modernbert":
        return None
    return ModernHeadSpec(pooling="cls", bias=False, activation=_activation(ACT_TO_HF[cfg.activation]),
                          norm_eps=cfg.layer_norm_eps, norm_bias=False, dropout=0.0,
                          dense_std=cfg.init_std / math.sqrt(2.0 * cfg.num_layers), cutoff=2.0)


class ModernGlueHead(nn.Module):
    """ModernBertForSequenceClassification's: ModernBertPredictionHead (dense -> activation -> LayerNorm) -> dropout
    -> out on the pooled state, x_BD -> logits_BC. Init as its _init_weights: truncated normals, the dense with
    spec.dense_std, out with hidden ** -0.5; biases 0, LayerNorm 1 and 0."""

    def __init__(self, hidden: int, num_labels: int, spec: ModernHeadSpec, dropout: float,
                 generator: torch.Generator):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, bias=spec.bias)
        self.act = spec.activation
        self.norm = nn.LayerNorm(hidden, eps=spec.norm_eps, bias=spec.norm_bias)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, num_labels)
        for lin, std in ((self.dense, spec.dense_std), (self.out, hidden ** -0.5)):
            with torch.no_grad():
                nn.init.trunc_normal_(lin.weight, 0.0, std, -spec.cutoff * std, spec.cutoff * std,
                                      generator=generator)
                if lin.bias is not None:
                    lin.bias.zero_()

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.norm(self.act(self.dense(x_BD)))))


def bert_pooler_of(backbone: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """h_BTD -> tanh(W h_cls + b) by the backbone's own (pretrained) pooler where BertForSequenceClassification would
    read it: transformers' BertModel, ours at arch bert, post-norm, positions from 0 (to-hf writes those as a
    BertModel). None for RoBERTa / pre-LN / ModernBERT, whose transformers classifiers ignore any pooler, and for a
    model without one (model.pooler=false; its export's BertModel holds zeros there, which either backend skips)."""
    hf = getattr(backbone, "hf", None)
    if hf is not None:
        pooler = getattr(hf, "pooler", None)
        if getattr(hf.config, "model_type", None) != "bert" or pooler is None:
            return None
        if (getattr(hf.config, "pretrain", None) or {}).get("pooler") is False:  # our export's zeros: not a pooler
            return None
        return lambda h_BTD: pooler(h_BTD)  # BertPooler reads [CLS] itself
    pooler, cfg = getattr(backbone, "pooler", None), getattr(backbone, "cfg", None)
    if pooler is None or cfg is None:
        return None
    if (getattr(cfg, "arch", "bert"), getattr(cfg, "norm", "post"), getattr(cfg, "position_offset", 0)) != (
            "bert", "post", 0):
        return None
    return lambda h_BTD: pooler(h_BTD[:, 0])


class GlueModel(nn.Module):
    """backbone -> BERT's pooler and dropout -> Linear where it has one (bert_pooler_of), ModernBERT's head on a
    ModernBERT (modernbert_head_of), else RoBERTa's head. ``dropout`` None: the head's own (FinetuneConfig.dropout)."""

    def __init__(self, backbone: nn.Module, hidden: int, num_labels: int, dropout: float | None,
                 generator: torch.Generator):
        super().__init__()
        self.backbone = backbone
        self.pooler = bert_pooler_of(backbone)  # its weights are the backbone's: trained with it, not registered twice
        modern = None if self.pooler is not None else modernbert_head_of(backbone)
        if modern is not None:
            self.dropout = modern.dropout if dropout is None else dropout
            self.head = ModernGlueHead(hidden, num_labels, modern, self.dropout, generator)
            self.pooling = modern.pooling
        else:
            self.dropout = 0.1 if dropout is None else dropout
            self.head = GlueHead(hidden, num_labels, self.dropout, generator, dense=self.pooler is None)
            self.pooling = "cls"
        self.one_token_type = num_token_types(backbone) == 1

    def forward(self, ids_BT, mask_BT, types_BT=None) -> torch.Tensor:
        # one token type (type_vocab_size 1): a [CLS] a [SEP] b [SEP] pair is all type 0, as RoBERTa's pairs are
        types_BT = None if self.one_token_type else types_BT
        h_BTD, _ = run_encode(self.backbone, ids_BT, mask_BT, types_BT=types_BT)
        if self.pooler is not None:
            return self.head(self.pooler(h_BTD))
        if self.pooling == "mean":  # ModernBertForSequenceClassification's mean over the attention mask
            return self.head((h_BTD * mask_BT.unsqueeze(-1)).sum(dim=1) / mask_BT.sum(dim=1, keepdim=True))
        return self.head(h_BTD[:, 0])


def hidden_size_of(backbone: nn.Module) -> int:
    for attr in ("hidden_size",):
        if hasattr(backbone, attr):
            return int(getattr(backbone, attr))
    cfg = getattr(backbone, "cfg", None) or getattr(backbone, "config", None)
    if cfg is not None and hasattr(cfg, "hidden_size"):
        return int(cfg.hidden_size)
    raise ValueError("cannot find the backbone's hidden size (expected .hidden_size or .cfg.hidden_size)")


def num_token_types(backbone: nn.Module) -> int:
    """Rows of the backbone's token-type table (ours: .cfg, transformers': .hf.config); 2 when it does not say."""
    cfg = getattr(backbone, "cfg", None) or getattr(getattr(backbone, "hf", None), "config", None)
    return int(getattr(cfg, "type_vocab_size", 2))


def encode_split(split: GlueSplit, tokenizer, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Per example (ids, token_types) with [CLS] a [SEP] (b [SEP])."""
    ta = tokenize_all(tokenizer, split.text_a)
    tb = tokenize_all(tokenizer, split.text_b) if split.text_b is not None else [None] * len(ta)
    return [add_specials(a, b, tokenizer, max_len) for a, b in zip(ta, tb)]


def collate(examples, pad_id: int, device: str):
    ids_BT, mask_BT = pad_batch([e[0] for e in examples], pad_id)
    types_BT, _ = pad_batch([e[1] for e in examples], 0)
    return ids_BT.to(device), mask_BT.to(device), types_BT.to(device)


def predict(model: GlueModel, encoded, task: TaskSpec, pad_id: int, cfg: FinetuneConfig) -> np.ndarray:
    """Class ids (or regression scores) for encoded examples, length-sorted batches, eval mode."""
    model.eval()
    order = np.argsort([-len(e[0]) for e in encoded], kind="stable")
    out = np.zeros(len(encoded), dtype=np.float64 if task.labels is None else np.int64)
    with torch.no_grad(), torch.autocast(cfg.device.split(":")[0], torch.bfloat16, enabled=cfg.bf16):
        for i in range(0, len(order), cfg.eval_batch_size):
            idx = order[i : i + cfg.eval_batch_size]
            logits_BC = model(*collate([encoded[j] for j in idx], pad_id, cfg.device)).float()
            out[idx] = (logits_BC[:, 0] if task.labels is None else logits_BC.argmax(-1)).cpu().numpy()
    model.train()
    return out


def evaluate_dev(model, dev_sets, task, pad_id, cfg) -> dict[str, float]:
    """Metrics per dev split; `score` = mean of the splits' scores (MNLI m/mm)."""
    res, scores = {}, []
    for name, (enc, lab) in dev_sets.items():
        m = compute_metrics(task, predict(model, enc, task, pad_id, cfg), lab)
        scores.append(m["score"])
        res.update({(k if len(dev_sets) == 1 else f"{name}/{k}"): v for k, v in m.items()})
    res["score"] = float(np.mean(scores))
    return res


def linear_warmup_decay(step: int, total: int, warmup: int) -> float:
    """LR factor of update ``step`` (0-based), transformers' get_linear_schedule_with_warmup: step / warmup while
    warming up (0 at the first update), then linear from 1 to 0 at ``total``."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def warmup_steps(warmup_ratio: float, total: int) -> int:
    """Warm-up updates as Trainer counts them (TrainingArguments.get_warmup_steps): ceil(ratio * total)."""
    return math.ceil(total * warmup_ratio)


def _encoded_splits(task, glue_dir, tokenizer, cfg: FinetuneConfig, gen: torch.Generator) -> tuple[list, dict]:
    """The training examples encoded, in a seeded order (cut to cfg.max_train_examples), as (encoding, label)
    pairs, and each dev split as (encodings, labels)."""
    train = read_split(task, glue_dir, "train")
    perm = torch.randperm(len(train), generator=gen).numpy()
    if cfg.max_train_examples:
        perm = perm[: cfg.max_train_examples]
    train_enc = encode_split(train, tokenizer, cfg.max_len)
    dev_sets = {}
    for s in task.dev_splits:
        d = read_split(task, glue_dir, s)
        dev_sets[s] = (encode_split(d, tokenizer, cfg.max_len), d.label)
    return [(train_enc[i], train.label[i]) for i in perm], dev_sets


def _optimizer(model: nn.Module, cfg: FinetuneConfig, total_steps: int):
    """AdamW (no decay on biases and norms) and the linear warm-up/decay schedule over ``total_steps``."""
    no_decay = lambda n: n.endswith("bias") or "norm" in n.lower()  # noqa: E731
    groups = [
        {"params": [p for n, p in model.named_parameters() if not no_decay(n)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if no_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    warmup = warmup_steps(cfg.warmup_ratio, total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_warmup_decay(s, total_steps, warmup))


def _cuda_devices(device: str) -> list[int]:
    """The CUDA devices whose generators ``torch.manual_seed`` reseeds when the run is on a GPU (all of them)."""
    return list(range(torch.cuda.device_count())) if torch.device(device).type == "cuda" else []


def finetune(cfg: FinetuneConfig, backbone: nn.Module, tokenizer, glue_dir: str | Path,
             save_dir: str | Path | None = None, log=print) -> dict:
    """Fine-tune `backbone` on one task; returns {config, best dev metrics, history, wall_s}. The backbone is trained
    in place: pass a freshly loaded one to each run (pretrain-finetune-glue loads it per run)."""
    task = get_task(cfg.task)
    t0 = time.time()
    gen = torch.Generator().manual_seed(cfg.seed)
    train_enc, dev_sets = _encoded_splits(task, glue_dir, tokenizer, cfg, gen)

    best, best_state, history, step = None, None, [], 0
    # nn.Linear init and dropout draw from torch's global generators (dropout on a GPU from the CUDA one, which
    # torch.manual_seed seeds on every device): fork them so the caller's RNG state is untouched, and seed them so
    # runs are reproducible
    with torch.random.fork_rng(devices=_cuda_devices(cfg.device)):
        torch.manual_seed(cfg.seed)
        model = GlueModel(backbone, hidden_size_of(backbone), task.num_labels, cfg.dropout, gen).to(cfg.device)
        steps_per_epoch = (len(train_enc) + cfg.batch_size - 1) // cfg.batch_size
        opt, sched = _optimizer(model, cfg, steps_per_epoch * cfg.epochs)
        loss_fn = nn.MSELoss() if task.labels is None else nn.CrossEntropyLoss()
        label_dtype = torch.float32 if task.labels is None else torch.long
        model.train()
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(train_enc), generator=gen).tolist()
            for b in range(steps_per_epoch):
                batch = [train_enc[i] for i in order[b * cfg.batch_size : (b + 1) * cfg.batch_size]]
                ids_BT, mask_BT, types_BT = collate([e for e, _ in batch], tokenizer.pad_id, cfg.device)
                y_B = torch.tensor(np.array([y for _, y in batch]), dtype=label_dtype, device=cfg.device)
                with torch.autocast(cfg.device.split(":")[0], torch.bfloat16, enabled=cfg.bf16):
                    logits_BC = model(ids_BT, mask_BT, types_BT).float()
                loss = loss_fn(logits_BC[:, 0], y_B) if task.labels is None else loss_fn(logits_BC, y_B)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.max_grad_norm > 0:  # Trainer's and BERT's clip_by_global_norm, over every parameter
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                sched.step()
                step += 1
                last = b == steps_per_epoch - 1
                if (cfg.eval_every and step % cfg.eval_every == 0) or (not cfg.eval_every and last):
                    m = evaluate_dev(model, dev_sets, task, tokenizer.pad_id, cfg)
                    m.update(epoch=epoch + 1, step=step, loss=loss.item(), elapsed_s=time.time() - t0)
                    history.append(m)
                    log(f"[{task.name} lr={cfg.lr} seed={cfg.seed}] epoch {epoch + 1} step {step}: "
                        f"dev score {m['score']:.2f} (loss {loss.item():.4f}, {m['elapsed_s']:.0f}s)")
                    if best is None or rank_score(m["score"]) > rank_score(best["score"]):
                        best = m
                        if save_dir is not None:  # one copy per tensor: safetensors stores no shared ones
                            best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if save_dir is not None and best_state is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        # Weights travel as safetensors, never a pickle: whoever opens them runs no code (the user's umask applies).
        save_safetensors(best_state, Path(save_dir) / BEST_WEIGHTS)
    config = {**asdict(cfg), "dropout": model.dropout}  # the dropout the head used (cfg.dropout None: its own)
    return {"task": task.name, "config": config, "num_train": len(train_enc), "steps": step,
            "best": best, "history": history, "wall_s": time.time() - t0}
