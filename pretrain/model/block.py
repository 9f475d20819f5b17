"""One Transformer encoder layer: self-attention + feed-forward, post-LN (BERT) or pre-LN.

Shapes: B batch, T sequence length, D hidden size, F feed-forward size; unpadded (``packed``), x_ND of N
packed tokens takes x_BTD's place (everything but attention is per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.attention import SelfAttention
from pretrain.model.dropout import Dropout
from pretrain.model.flat import forget_traced_views, materialize
from pretrain.model.kernels import KINDS, cpu_kernels
from pretrain.model.packing import Packed, take_rows


GELU_FORMS = {"gelu": "none", "gelu_tanh": "tanh"}
"""The ModelConfig.activation names that are GELU, with ``F.gelu``'s ``approximate`` for each."""


def activation_fn(name: str):
    """Name from ModelConfig.activation -> elementwise function (``gelu`` is the exact erf form)."""
    if name == "gelu":
        return F.gelu
    if name in GELU_FORMS:
        return lambda x: F.gelu(x, approximate=GELU_FORMS[name])
    if name == "relu":
        return F.relu
    raise ValueError(f"model.activation must be one of gelu, gelu_tanh, relu; got {name!r}")


class FeedForward(nn.Module):
    """x_BTD -> down(act(up(x))), without the output dropout. Training on the CPU with erf's GELU, the bias and the
    GELU are one pass of the C kernel each way (``_BiasGelu``): up's matmul without its bias, then gelu(z + b).
    Evaluation keeps torch's GELU (the exported model's, which the equivalence tests with transformers compare)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size)
        self.act = activation_fn(cfg.activation)
        self.exact_gelu = cfg.activation == "gelu"

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.exact_gelu and self.training and _bias_gelu_in_c(x_BTD, self.up.weight, self.up.bias):
            return self.down(_BiasGelu.apply(F.linear(x_BTD, self.up.weight), self.up.bias))
        return self.down(self.act(self.up(x_BTD)))


def _bias_gelu_in_c(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a training ``FeedForward`` takes ``_BiasGelu``: the C module built, the CPU, eager, fp32/bf16, a bias,
    and parameters that are whole tensors (not ZeRO-3's partitions, which are gathered only inside the module's own
    call). Not asked whether gradients are on: the contrastive cache's first pass (no gradients) and its replay
    must compute the same embeddings bit for bit (training/cached_step.py)."""
    return (bias is not None and x.device.type == "cpu" and x.numel() > 0
            and not torch.compiler.is_compiling() and cpu_kernels() is not None
            and x.dtype in KINDS and bias.dtype in KINDS and not hasattr(weight, "ds_id"))


class _BiasGelu(torch.autograd.Function):
    """gelu(z + b) (erf's GELU) of a (..., F) z and (F,) b in one pass of the C kernel (``bias_gelu``); backward
    z's gradient and b's (its column sums, float32, the same for any thread count) in one pass, where autograd's
    addmm backward reads the gradient once more to sum it. Saves z and b."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        z, bias = z.contiguous(), bias.contiguous()
        h = torch.empty_like(z)
        cpu_kernels().bias_gelu(z.data_ptr(), bias.data_ptr(), KINDS[bias.dtype], 0, h.data_ptr(), 0,
                                z.numel() // z.shape[-1], z.shape[-1], KINDS[z.dtype], torch.get_num_threads())
        ctx.save_for_backward(z, bias)
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        z, bias = ctx.saved_tensors
        grad_h = grad_h.to(z.dtype).contiguous()
        grad_z = torch.empty_like(z)
        grad_b = torch.empty(z.shape[-1], dtype=torch.float32)
        cpu_kernels().bias_gelu(z.data_ptr(), bias.data_ptr(), KINDS[bias.dtype], grad_h.data_ptr(), grad_z.data_ptr(),
                                grad_b.data_ptr(), z.numel() // z.shape[-1], z.shape[-1], KINDS[z.dtype],
                                torch.get_num_threads())
        return grad_z, grad_b.to(bias.dtype)


class Block(nn.Module):
    """post-LN: x = LN(x + drop(attn(x))); x = LN(x + drop(ffn(x))).
    pre-LN:  x = x + drop(attn(LN(x)));  x = x + drop(ffn(LN(x)))  (the encoder adds a final LN).
    """

    FLAT_SPANS = {"attn.qkv_span": (("attn.q.weight", "attn.k.weight", "attn.v.weight"),
                                    ("attn.q.bias", "attn.k.bias", "attn.v.bias"))}
    """Flattened (model/flat.py), q/k/v's weights and biases lie end to end: attention projects with one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, keep_B11T: torch.Tensor | None,
                packed: Packed | None = None, rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD (x_ND with ``packed``) -> the layer's output; with ``rows_S`` x_SD, only those tokens' (keys,
        values and attention from all; the output projection, the FFN and the norms then run on S rows)."""
        materialize(self)  # a flattened layer's parameter views (model/flat.py)
        x_SD = take_rows(x_BTD, rows_S)  # x_BTD itself without rows_S
        if self.pre_norm:
            x_SD = x_SD + self.dropout(self.attn(self.attn_norm(x_BTD), keep_B11T, packed, rows_S))
            x_SD = x_SD + self.dropout(self.ffn(self.ffn_norm(x_SD)))
        else:
            x_SD = self.attn_norm(x_SD + self.dropout(self.attn(x_BTD, keep_B11T, packed, rows_S)))
            x_SD = self.ffn_norm(x_SD + self.dropout(self.ffn(x_SD)))
        forget_traced_views(self)
        return x_SD
