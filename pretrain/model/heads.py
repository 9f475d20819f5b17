"""Heads on top of the encoder: tied MLM head, BERT pooler, CLEAR projection, sentence pooling.

Shapes: B batch, T sequence length, D hidden size, M masked (predicted) positions,
V vocabulary, P projection size (D also stands for the sentence embedding size, dense_dim when set), N packed
tokens of an unpadded batch (packing.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.block import activation_fn
from pretrain.model.packing import Packed

POOLINGS = ("cls", "cls_before_pooler", "mean", "first_last_avg")


class MLMHead(nn.Module):
    """h_MD -> logits_MV: dense -> act -> LayerNorm -> decoder (tied to the word embeddings) + bias. ModernBERT's
    dense and norm have no bias (cfg.bias); the decoder's output bias stays, as in ModernBertForMaskedLM."""

    def __init__(self, cfg: ModelConfig, word_weight_VD: nn.Parameter) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.act = activation_fn(cfg.activation)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.bias)
        # The decoder owns no storage: its weight IS the embedding Parameter (as in HF, so
        # DeepSpeed ZeRO-3 gathers it for this module like any other registered parameter).
        self.decoder = nn.Module()
        self.decoder.weight = word_weight_VD
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.step_weight: torch.Tensor | None = None
        """``TiedWord``'s decoder alias of the weight while ``PretrainModel.word_rows`` holds it."""

    def forward(self, h_MD: torch.Tensor) -> torch.Tensor:
        x_MD = self.norm(self.act(self.dense(h_MD)))
        weight_VD = self.decoder.weight if self.step_weight is None else self.step_weight
        return decoder_logits(x_MD, weight_VD, self.bias)


DECODER_CHUNK = 2048
"""Vocabulary rows per matmul of the CPU decoder (``decoder_logits``)."""


def decoder_logits(x_MD: torch.Tensor, w_VD: torch.Tensor, b_V: torch.Tensor) -> torch.Tensor:
    """``F.linear(x_MD, w_VD, b_V)``, the MLM decoder; on the CPU (eager, float32, no autocast, a vocabulary of at
    least two chunks) computed ``DECODER_CHUNK`` vocabulary rows at a time. One (M, D) x (D, 30,522) matmul runs at
    about 95 GFLOP/s on a 2-core AMD EPYC, the same work in 2,048-column pieces at 130-160 (its backward's two
    matmuls, whose long dimension is the reduction or the rows, at 165-190 already): ModernBERT mini's decoder
    forward 83-97 ms -> 52-54 ms a step (docs/performance.md). Same arithmetic per element: each logit is one dot
    product of length D. Other dtypes keep ``F.linear`` (bf16 on an avx512_bf16 CPU: 327 GFLOP/s in one piece,
    303 in chunks)."""
    if (x_MD.device.type != "cpu" or torch.compiler.is_compiling() or w_VD.shape[0] < 2 * DECODER_CHUNK
            or torch.is_autocast_enabled("cpu") or x_MD.dtype != torch.float32 or w_VD.dtype != torch.float32
            or x_MD.dim() != 2):
        return F.linear(x_MD, w_VD, b_V)
    return _ChunkedDecoder.apply(x_MD, w_VD, b_V)


class _ChunkedDecoder(torch.autograd.Function):
    """logits_MV = x_MD w_VD^T + b_V, the forward in vocabulary chunks; the backward as ``F.linear``'s: grad_x = g w,
    grad_w = g^T x, grad_b = the column sums of g."""

    @staticmethod
    def forward(ctx, x_MD, w_VD, b_V):
        logits_MV = x_MD.new_empty(x_MD.shape[0], w_VD.shape[0])
        for start in range(0, w_VD.shape[0], DECODER_CHUNK):
            end = start + DECODER_CHUNK
            # Into a fresh (M, chunk) block, then copied: faster than addmm writing the strided columns itself.
            logits_MV[:, start:end] = torch.addmm(b_V[start:end], x_MD, w_VD[start:end].t())
        ctx.save_for_backward(x_MD, w_VD)
        return logits_MV

    @staticmethod
    def backward(ctx, g_MV):
        x_MD, w_VD = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        return (g_MV @ w_VD if need_x else None, g_MV.t() @ x_MD if need_w else None,
                g_MV.sum(0) if need_b else None)


class Pooler(nn.Module):
    """BERT's pooler: e_BD = tanh(dense(h[:, 0]))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls_BD: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_BD))


class SentenceDense(nn.Module):
    """A Dense layer after pooling (sentence-transformers' Dense): e_BD -> act(linear(e_BD)) of size dense_dim."""

    ACTIVATIONS = {"tanh": nn.Tanh, "identity": nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(cfg.hidden_size, cfg.dense_dim, bias=cfg.dense_bias)
        self.act = self.ACTIVATIONS[cfg.dense_activation]()

    def forward(self, e_BD: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(e_BD))


class ProjectionHead(nn.Module):
    """CLEAR's g(.): e_BD -> z_BP, ``projection_layers`` Linear layers with the activation between; with none, the
    identity (no parameters: the terms compare the pooled embedding)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        in_dim = cfg.sentence_dim
        out_dim = cfg.projection_dim or in_dim
        act = nn.ReLU if cfg.projection_activation == "relu" else nn.Tanh
        mods: list[nn.Module] = []
        for i in range(cfg.projection_layers):
            last = i == cfg.projection_layers - 1
            mods.append(nn.Linear(in_dim, out_dim if last else in_dim))
            if not last:
                mods.append(act())
        self.layers = nn.Sequential(*mods)

    def forward(self, e_BD: torch.Tensor) -> torch.Tensor:
        return self.layers(e_BD)


def masked_mean(h_BTD: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of h over the positions where attention_mask is 1 -> e_BD."""
    m_BT = attention_mask_BT.to(h_BTD.dtype)
    sum_BD = torch.bmm(m_BT.unsqueeze(1), h_BTD).squeeze(1)
    return sum_BD / m_BT.sum(dim=1, keepdim=True).clamp(min=1.0)


def pool(
    h_BTD: torch.Tensor,
    attention_mask_BT: torch.Tensor | None,
    pooling: str,
    *,
    pooler: Pooler | None = None,
    all_layers: list[torch.Tensor] | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """Sentence embeddings e_BD.

    "cls": [CLS] through the pooler when there is one, else [CLS]; "cls_before_pooler": [CLS];
    "mean": masked mean of h; "first_last_avg": masked mean of (layer 1 + layer L)/2 (SimCSE's
    definition, layer 1 = first Transformer layer's output), needs ``all_layers`` from encode.
    With ``packed`` the states are h_ND of an unpadded batch: [CLS] is each sequence's first token and the mean
    runs over its own tokens (the mask is not used).
    """
    def first(h):
        return packed.first(h) if packed is not None else h[:, 0]

    def mean(h):
        return packed.mean(h) if packed is not None else masked_mean(h, attention_mask_BT)

    if pooling == "cls":
        return pooler(first(h_BTD)) if pooler is not None else first(h_BTD)
    if pooling == "cls_before_pooler":
        return first(h_BTD)
    if pooling == "mean":
        return mean(h_BTD)
    if pooling == "first_last_avg":
        if not all_layers or len(all_layers) < 2:
            raise ValueError("pooling 'first_last_avg' needs all_layers: call encode(..., all_layers=True) first")
        return mean((all_layers[1] + all_layers[-1]) * 0.5)
    raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
