"""The ModernBERT encoder (model.arch=modernbert; Warner et al. 2024, transformers' ModernBertModel arithmetic).

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K), F feed-forward (gated) size,
N packed tokens (unpadded, see packing.py), n rows and t length of an attention group.

    x = drop(norm(word[ids]))                                  (no position table: rotary in attention)
    layer i: x = x + drop(attn_i(norm(x)))   (layer 0 takes x as it is: the embedding norm just ran)
             x = x + drop(Wo(act(u) * g)),  [u, g] = Wi(norm(x))                                    (GeGLU)
    h = norm(x)                                                                                 (final norm)
attn_i is global when i % global_every == 0, else local: a token sees keys within local_window // 2 positions,
in its own sequence. No linear layer or norm has a bias. Everything but attention is per token, so the unpadded
path runs it on the (N, D) stream; attention rotates q and k by the packed position ids (each sequence restarts
at 0) and composes the window with each attention group's key mask (a group's row is one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.block import activation_fn
from pretrain.model.packing import Packed
from pretrain.model.rotary import apply_rope, rope_tables, window_mask


@dataclass
class AttentionInputs:
    """What every layer of one kind (global or local) shares in one forward: rotary tables and masks."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None = None
    """Padded path: (B, 1, T, T) / (T, T) / (B, 1, 1, T) or None."""
    group_masks: tuple[torch.Tensor | None, ...] = ()
    """Unpadded path: one mask per attention group of ``packed``."""


def is_global_layer(cfg: ModelConfig, layer_id: int) -> bool:
    return layer_id % cfg.global_every == 0


class ModernEmbeddings(nn.Module):
    """ids -> drop(norm(word[ids])); token types and positions are not embedded (rotary acts in attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(self.word(input_ids)))


class ModernAttention(nn.Module):
    """Fused bias-free q/k/v projection (transformers' Wqkv layout: q, k, v stacked), RoPE, SDPA, output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_size = cfg.num_heads, d // cfg.num_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.attention_dropout = cfg.attention_dropout

    def forward(self, x_BTD: torch.Tensor, inputs: AttentionInputs, packed: Packed | None) -> torch.Tensor:
        """x_BTD -> y_BTD (x_ND -> y_ND with ``packed``), before the residual."""
        h, k = self.num_heads, self.head_size
        dropout_p = self.attention_dropout if self.training else 0.0
        if packed is not None:
            q_NHK, k_NHK, v_NHK = self.qkv(x_BTD).view(-1, 3, h, k).unbind(1)
            cos_N1K, sin_N1K = inputs.cos[:, None], inputs.sin[:, None]
            q_NHK, k_NHK = apply_rope(q_NHK, cos_N1K, sin_N1K), apply_rope(k_NHK, cos_N1K, sin_N1K)
            y_parts = []
            for g, mask in zip(packed.groups, inputs.group_masks):
                q_nHtK, k_nHtK, v_nHtK = (z.index_select(0, g.index_P).view(g.num_rows, g.length, h, k).transpose(1, 2)
                                          for z in (q_NHK, k_NHK, v_NHK))
                y_nHtK = F.scaled_dot_product_attention(q_nHtK, k_nHtK, v_nHtK, attn_mask=mask, dropout_p=dropout_p)
                y_parts.append(y_nHtK.transpose(1, 2).reshape(g.num_rows * g.length, h * k))
            y_PD = y_parts[0] if len(y_parts) == 1 else torch.cat(y_parts)
            return self.out(y_PD.index_select(0, packed.back_N))
        b, t, d = x_BTD.shape
        q_BHTK, k_BHTK, v_BHTK = self.qkv(x_BTD).view(b, t, 3, h, k).permute(2, 0, 3, 1, 4).unbind(0)
        q_BHTK, k_BHTK = apply_rope(q_BHTK, inputs.cos, inputs.sin), apply_rope(k_BHTK, inputs.cos, inputs.sin)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, attn_mask=inputs.mask, dropout_p=dropout_p)
        return self.out(y_BHTK.transpose(1, 2).reshape(b, t, d))


class GeGLU(nn.Module):
    """x -> Wo(act(u) * g) with [u, g] = Wi(x) (Wi: D -> 2F, u first, as transformers' ModernBertMLP)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.wo = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)
        self.act = activation_fn(cfg.activation)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        u_BTF, g_BTF = self.wi(x_BTD).chunk(2, dim=-1)
        return self.wo(self.act(u_BTF) * g_BTF)


class ModernBlock(nn.Module):
    """Pre-norm layer; layer 0 has no attention norm (the embedding norm precedes it), as in ModernBERT."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_global = is_global_layer(cfg, layer_id)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False) if layer_id else None
        self.attn = ModernAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.ffn = GeGLU(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, inputs: AttentionInputs, packed: Packed | None = None) -> torch.Tensor:
        a_BTD = x_BTD if self.attn_norm is None else self.attn_norm(x_BTD)
        x_BTD = x_BTD + self.dropout(self.attn(a_BTD, inputs, packed))
        return x_BTD + self.dropout(self.ffn(self.ffn_norm(x_BTD)))


class ModernEncoder(nn.Module):
    """input_ids_BT, attention_mask_BT (1 = token, 0 = padding) -> h_BTD; the same interface as encoder.Encoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = ModernEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)

    def forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *, all_layers: bool = False,
        token_type_ids_BT: torch.Tensor | None = None, padded: bool | None = None, packed: Packed | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """As ``Encoder.forward`` (token types are accepted and ignored: ModernBERT has none). There is no
        length limit: rotary positions work at any length (model.max_position is only what the export states)."""
        if packed is not None:
            x_ND = self.embeddings(packed.ids_N)
            return self._layers(x_ND, self._inputs(packed.position_ids_N, x_ND.dtype, None, packed), packed,
                                all_layers)
        keep_B11T = None
        if attention_mask_BT is not None:
            if padded is None:
                padded = torch.compiler.is_compiling() or not bool(attention_mask_BT.all())
            if padded:
                keep_B11T = attention_mask_BT.bool()[:, None, None, :]
        x_BTD = self.embeddings(input_ids_BT)
        pos_T = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
        return self._layers(x_BTD, self._inputs(pos_T, x_BTD.dtype, keep_B11T, None), None, all_layers)

    def _inputs(self, position_ids: torch.Tensor, dtype: torch.dtype, keep_B11T: torch.Tensor | None,
                packed: Packed | None) -> dict[bool, AttentionInputs]:
        """{is_global: AttentionInputs}: rotary tables per base, and the masks (the window composed with the
        padding or with each attention group's key mask), built once per forward, not per layer."""
        cfg, head_size = self.cfg, self.cfg.hidden_size // self.cfg.num_heads
        half, device = cfg.local_window // 2, position_ids.device
        out = {}
        for is_global, theta in ((True, cfg.rope_theta), (False, cfg.rope_theta_local)):
            if not any(layer.is_global == is_global for layer in self.layers):
                continue
            cos, sin = rope_tables(position_ids, head_size, theta, dtype)
            if packed is not None:
                masks = tuple(g.keep_n11t if is_global else window_mask(g.keep_n11t, g.length, half, device)
                              for g in packed.groups)
                out[is_global] = AttentionInputs(cos, sin, group_masks=masks)
            else:
                mask = keep_B11T if is_global else window_mask(keep_B11T, position_ids.shape[0], half, device)
                out[is_global] = AttentionInputs(cos, sin, mask=mask)
        return out

    def _layers(self, x_BTD: torch.Tensor, inputs: dict[bool, AttentionInputs], packed: Packed | None,
                all_layers: bool) -> torch.Tensor | list[torch.Tensor]:
        states = [x_BTD] if all_layers else None
        for layer in self.layers:
            x_BTD = layer(x_BTD, inputs[layer.is_global], packed)
            if all_layers:
                states.append(x_BTD)
        x_BTD = self.final_norm(x_BTD)
        if all_layers:
            states[-1] = x_BTD
        return states if all_layers else x_BTD

    def compile_layers(self, **kwargs) -> None:
        """torch.compile every block in place."""
        for layer in self.layers:
            layer.compile(**kwargs)
