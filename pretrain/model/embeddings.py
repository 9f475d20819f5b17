"""Token + learned absolute position (+ BERT token-type 0) embeddings, LayerNorm, dropout.

Shapes: B batch, T sequence length, D hidden size, V vocabulary; unpadded, ids_N of N packed tokens with their
position_ids_N (packing.py) take ids_BT's place.

Positions: token i of a sequence takes row offset + i of the position table (model.position_offset: 0 for BERT,
pad_token_id + 1 = 2 for RoBERTa). With an offset, i counts a row's real tokens only and padding takes row
offset - 1, RoBERTa's rule (its create_position_ids_from_input_ids, which counts ids != pad where we count the
attention mask: the same for tokenizer output), so padding's outputs equal transformers' too, on either side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.dropout import Dropout


@torch.library.custom_op("pretrain::embedding_grad", mutates_args=())
def embedding_grad(grad: torch.Tensor, ids: torch.Tensor, rows: int, padding_idx: int) -> torch.Tensor:
    """The gradient of an embedding table (``rows`` x D) from its lookup's output gradient: aten's own kernel, as an
    op torch.compile keeps whole (see ``Embedding``)."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding_idx, False)


@embedding_grad.register_fake
def _embedding_grad_shape(grad, ids, rows, padding_idx):
    return grad.new_empty((rows, grad.shape[-1]))


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward is ``embedding_grad``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return embedding_grad(grad, ids, ctx.rows, ctx.padding_idx), None, None


class _RowsLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient is sparse: one row per token (its output gradient, at its
    id), an uncoalesced COO tensor over the output gradient itself (nothing summed, sorted or copied). Only for
    ``TiedWord``'s lookup alias, whose backward adds the rows into the decoder's dense gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return torch.sparse_coo_tensor(ids.reshape(1, -1).long(), grad.reshape(-1, grad.shape[-1]), ctx.shape,
                                       is_coalesced=False, check_invariants=False), None


class TiedWord(torch.autograd.Function):
    """The tied word table as two aliases, (lookup's, decoder's), whose gradients meet in one backward.

    Autograd otherwise sums a tied table's two gradients as two dense (V, D) tensors: the lookup's, aten's
    zero-filled table with the tokens' rows added (``embedding_dense_backward``), and the decoder's; at BERT small
    on the CPU 62 MB filled, then read twice and written once more for a few thousand rows (~20 ms a step). Here
    the lookup's gradient comes as rows (``_RowsLookup``; two lookups' rows concatenated by autograd) and they are
    added into the decoder's gradient in place, token by token (``index_add_``): each element is the decoder's
    gradient plus its tokens' in token order, where autograd added the tokens' sum to it, so the two differ by
    rounding only. Without a decoder gradient (the step ran no MLM head) the rows go into zeros in token order:
    aten's dense backward, to the bit. ``PretrainModel.word_rows`` says where it runs."""

    @staticmethod
    def forward(ctx, weight_VD: torch.Tensor):
        ctx.set_materialize_grads(False)  # an unused alias's gradient stays None, not a zero (V, D) table
        return weight_VD.view_as(weight_VD), weight_VD.view_as(weight_VD)

    @staticmethod
    def backward(ctx, grad_lookup, grad_decoder):
        if grad_lookup is None:
            return grad_decoder
        # grad_lookup: the sparse rows of _RowsLookup, the lookup alias's only reader
        if grad_decoder is None:
            grad_decoder = grad_lookup._values().new_zeros(grad_lookup.shape)
        # The decoder's gradient is a fresh (V, D) product of its backward, read by no other node: added in place.
        return grad_decoder.index_add_(0, grad_lookup._indices()[0], grad_lookup._values())


class Embedding(nn.Embedding):
    """nn.Embedding that leaves its default N(0, 1) init out on the meta device, and whose compiled gradient on the
    CPU is the eager one.

    ``build_model`` builds the model on the meta device and initialises it after allocation; there nn.Embedding's own
    ``normal_`` would be thrown away, and on a meta tensor it runs torch's Python reference kernel, whose first call
    imports ``torch._dynamo`` (~2 s of CPU for every process that builds a model). Built on a real device, it is
    nn.Embedding.

    Compiled (train.compile), inductor decomposes the lookup's backward into a scatter whose threads add into the
    table's rows with atomic adds (its CPU code's ``atomic_add_vec``): a token that occurs several times gets its
    gradients summed in whatever order the threads arrive, so two identical compiled CPU runs drifted apart in the
    last bits from their fourth step on (2 threads, fp32, 2e-7 relative after 30 steps; bitwise equal with one
    thread; docs/operations.md), and no compiled run resumed exactly. On the CPU the compiled lookup's backward is
    therefore ``embedding_grad``, which inductor runs as aten's kernel (deterministic, the one the eager step runs);
    the forward stays an ordinary gather that fuses with what follows. On a GPU the compiled step keeps inductor's
    scatter (Triton's ``atomic_add``, so not bitwise reproducible): aten's CUDA kernel sorts the ids with a Thrust
    call that waits for the host past ~4k ids, which a CUDA graph (compile_mode=reduce-overhead) cannot capture and
    which would put a host sync back into every step (pytorch/pytorch#82886)."""

    step_weight: torch.Tensor | None = None
    """``TiedWord``'s lookup alias of the weight while ``PretrainModel.word_rows`` holds it: the lookup then
    gives its gradient as rows (``_RowsLookup``)."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.step_weight is not None:
            return _RowsLookup.apply(self.step_weight, ids)
        if (torch.compiler.is_compiling() and self.weight.device.type == "cpu" and self.max_norm is None
                and not self.scale_grad_by_freq and not self.sparse):
            return _Lookup.apply(self.weight, ids, -1 if self.padding_idx is None else self.padding_idx)
        return super().forward(ids)


class Embeddings(nn.Module):
    """ids_BT -> x_BTD = LayerNorm(word[ids] + token_type[types or 0] + position[offset + i]), then dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = Embedding(cfg.max_position, cfg.hidden_size)
        self.offset = cfg.position_offset
        # BERT's segment embeddings: pretraining uses type 0 only; sentence-pair fine-tuning (GLUE) passes
        # token_type_ids_BT with 1 on the second segment, as BERT does.
        self.token_type = Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.dropout)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table holds (its rows less the offset)."""
        return self.position.num_embeddings - self.offset

    def forward(self, input_ids_BT: torch.Tensor, token_type_ids_BT: torch.Tensor | None = None,
                position_ids_N: torch.Tensor | None = None, attention_mask_BT: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """x_BTD, or x_ND for packed ids_N with ``position_ids_N`` (each sequence's positions restart at 0; the
        caller checks them against max_position on the host). ``attention_mask_BT`` (1 = token): only given for a
        padded batch, and used only with a position offset (padding then takes row offset - 1)."""
        # Same summation order as BERT/RoBERTa (word + type, then + position) so fp32 results match bit for bit.
        types = self.token_type.weight[0] if token_type_ids_BT is None else self.token_type(token_type_ids_BT)
        x = self.word(input_ids_BT) + types
        if position_ids_N is not None:
            if self.offset:
                position_ids_N = position_ids_N + self.offset
            return self.dropout(self.norm(x + self.position(position_ids_N)))
        num_tokens = input_ids_BT.shape[1]
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"sequence length {num_tokens} exceeds the {self.max_tokens} positions of model.max_position="
                f"{self.position.num_embeddings} (model.position_offset={self.offset}); truncate inputs "
                "(data.max_len) or build the model with a larger max_position"
            )
        if self.offset and attention_mask_BT is not None:
            keep_BT = attention_mask_BT.long()
            x = x + self.position(torch.cumsum(keep_BT, dim=1) * keep_BT + (self.offset - 1))
        else:
            x = x + self.position.weight[self.offset:self.offset + num_tokens]
        return self.dropout(self.norm(x))
