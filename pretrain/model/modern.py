"""The ModernBERT encoder (model.arch=modernbert; Warner et al. 2024, transformers' ModernBertModel arithmetic);
its layer is modern_block.py.

Shapes: B batch, T sequence length, D hidden size, N packed tokens (unpadded, see packing.py).

    x = drop(norm(word[ids]))                                  (no position table: rotary in attention)
    layer i: x = x + drop(attn_i(norm(x)))   (layer 0 takes x as it is: the embedding norm just ran)
             x = x + drop(Wo(act(u) * g)),  [u, g] = Wi(norm(x))                                    (GeGLU)
    h = norm(x)                                                                                 (final norm)
attn_i is global when i % global_every == 0, else local: a token sees keys within local_window // 2 positions,
in its own sequence. No linear layer or norm has a bias. Everything but attention is per token, so the unpadded
path runs it on the (N, D) stream; attention gathers the q/k/v projections into the attention groups' slots, where
each row is one sequence starting at slot 0, rotates q and k by their slot column (the sequence's own positions),
and composes the window with each group's key mask.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.banded import Band, make_band, use_band
from pretrain.model.flat import forget_traced_views, materialize
from pretrain.model.modern_block import AttentionInputs, ModernBlock, ModernEmbeddings, scaled_tables
from pretrain.model.packing import Packed, check_rows, keep_mask
from pretrain.model.rotary import rope_tables, window_mask


class ModernEncoder(nn.Module):
    """input_ids_BT, attention_mask_BT (1 = token, 0 = padding) -> h_BTD; the same interface as encoder.Encoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = ModernEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.band_when_compiled: bool | None = None
        """The local layers' band-or-dense choice inside a compiled step, the same for every sequence or attention
        group (``compile_band``); None chooses by each length there too. Chosen by length, the choice is a guard
        on each group's symbolic length, and a batch whose groups fall on other sides of the threshold than the
        traced one's is a new graph (up to one per group count: ModernBERT's 1024-token batches reached torch's
        recompile limit)."""

    def forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *, all_layers: bool = False,
        token_type_ids_BT: torch.Tensor | None = None, padded: bool | None = None, packed: Packed | None = None,
        rows_S: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """As ``Encoder.forward`` (token types are accepted and ignored: ModernBERT has none). There is no
        length limit: rotary positions work at any length (model.max_position is only what the export states)."""
        check_rows(rows_S, all_layers)
        if packed is not None:
            x_ND = self.embeddings(packed.ids_N)
            # A group's row is one sequence from its slot 0, so the tables are per slot column: (T, K).
            positions_T = torch.arange(packed.longest, device=x_ND.device)
            return self._layers(x_ND, self._inputs(positions_T, x_ND.dtype, None, packed), packed, all_layers, rows_S)
        keep_B11T = None if attention_mask_BT is None else keep_mask(attention_mask_BT, padded)
        x_BTD = self.embeddings(input_ids_BT)
        pos_T = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
        return self._layers(x_BTD, self._inputs(pos_T, x_BTD.dtype, keep_B11T, None), None, all_layers, rows_S)

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
                masks = tuple(g.keep_n11t if is_global else self._local_mask(g.keep_n11t, g.length, half, device)
                              for g in packed.groups)
                out[is_global] = AttentionInputs(cos, sin, group_masks=masks, **scaled_tables(cos, sin, head_size))
            else:
                mask = keep_B11T if is_global else self._local_mask(keep_B11T, position_ids.shape[0], half, device)
                out[is_global] = AttentionInputs(cos, sin, mask=mask, **scaled_tables(cos, sin, head_size))
        return out

    def _layers(self, x_BTD: torch.Tensor, inputs: dict[bool, AttentionInputs], packed: Packed | None,
                all_layers: bool, rows_S: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
        materialize(self.layers)  # flat across the layers (train.flat_scope=encoder): their views, model/flat.py
        states = [x_BTD] if all_layers else None
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, inputs[layer.is_global], packed, rows_S if i == len(self.layers) - 1 else None)
            if all_layers:
                states.append(x_BTD)
        x_BTD = self.final_norm(x_BTD)
        if all_layers:
            states[-1] = x_BTD
        forget_traced_views(self.layers)
        return states if all_layers else x_BTD


    def _local_mask(self, keep_B11T: torch.Tensor | None, length: int, half: int,
                    device: torch.device) -> torch.Tensor | Band | None:
        """A local layer's mask: the band (``banded.py``: only the scores within the window are computed) once the
        sequence is several windows long, else the dense window mask; in a compiled step ``band_when_compiled``
        when set (both are exact at any length)."""
        band = self.band_when_compiled
        if band is None or not torch.compiler.is_compiling():
            band = use_band(length, half)
        if band:
            return make_band(keep_B11T, length, half, device)
        return window_mask(keep_B11T, length, half, device)


def compile_band(model: nn.Module, max_len: int) -> None:
    """Fix ``band_when_compiled`` of ``model``'s ModernBERT encoder (if it has one) for sequences of at most
    ``max_len`` tokens: the band when the longest would take it, so that a compiled step has one graph whatever
    its groups' lengths (short groups then pay the band's blocking: at most 3 x half scores a query)."""
    for m in model.modules():
        if isinstance(m, ModernEncoder):
            m.band_when_compiled = use_band(max_len, m.cfg.local_window // 2)
