"""Row gathers whose backward copies instead of accumulating.

``x.index_select(0, index)``'s backward is ``index_add_`` into zeros: an atomic add per element on CUDA, which in
bf16 is slow. On the H200 (docs/performance.md, 2026-11-27) the unpadded step's gathers cost 15% of BERT-base's
GPU time that way (``indexFuncLargeIndex``, 50 calls a step, 0.42 ms each). Where the rows are known to be unique,
or each source row has one slot whose gradient is its whole gradient, the backward is a plain copy:

- ``gather_unique(x, index)``: ``index`` has no repeats; backward writes each row's gradient into zeros with
  ``index_copy_`` (rows not gathered get zero, as before).
- ``gather_slots(x_N, packed)``: every token's rows laid out in the attention groups' slots
  (``Packed.gather_P``), where padding slots repeat their row's last token. Backward gathers each token's
  gradient from its own slot (``Packed.back_N``): exact when the padding slots' gradients are zero, which they
  are in attention (a padding slot's query output is never read; its key and value are masked: probability
  exactly 0), the one place it is used.

Both give the same gradients as ``index_select`` (tests/unit/test_row_gather.py, against float64 and through the
unpadded encoder's gradients in tests/unit/test_unpadded.py).
"""

from __future__ import annotations

import torch


class _GatherUnique(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gather_P: torch.Tensor, back_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back_N)
        return x.index_select(0, gather_P)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back_N,) = ctx.saved_tensors
        return grad.index_select(0, back_N), None, None


class _GroupHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv_P: torch.Tensor, shapes: tuple[tuple[int, int], ...], heads: int, size: int):
        ctx.set_materialize_grads(False)
        ctx.shapes, ctx.heads, ctx.size = shapes, heads, size
        ctx.like = (qkv_P.shape, qkv_P.dtype, qkv_P.device)
        return tuple(_heads(qkv_P, shapes, heads, size))

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.like
        grad_P = torch.empty(shape, dtype=dtype, device=device)
        for z, g in zip(_heads(grad_P, ctx.shapes, ctx.heads, ctx.size), grads):
            if g is None:  # an output no loss read
                z.zero_()
            else:
                z.copy_(g)
        return grad_P, None, None, None


class _GroupHeadsTraced(torch.autograd.Function):
    """``group_heads`` in a compiled step: the backward stacks each group's q, k and v gradients into its slots'
    (n, t, 3, heads, size) order and concatenates the groups, which inductor writes piece by piece. Traced through
    the views instead, the slice, select and transpose backwards became one pointwise kernel a layer summing twelve
    zero-padded pieces per element: on the H200 (2026-11-28) 1.16 ms a layer, 13% of the compiled BERT-base step's
    GPU time; on the CPU (BERT mini, fp32, the books) 86 ms a step, 19 ms this way (docs/performance.md). A
    gradient no loss read arrives as zeros (materialised)."""

    @staticmethod
    def forward(ctx, qkv_P: torch.Tensor, shapes: tuple[tuple[int, int], ...], heads: int, size: int):
        ctx.shapes = shapes
        return tuple(_heads(qkv_P, shapes, heads, size))

    @staticmethod
    def backward(ctx, *grads):
        parts = [torch.stack([g.transpose(1, 2) for g in grads[3 * i:3 * i + 3]], dim=2).reshape(n * t, -1)
                 for i, (n, t) in enumerate(ctx.shapes)]
        return torch.cat(parts) if len(parts) > 1 else parts[0], None, None, None


def _heads(qkv_P: torch.Tensor, shapes, heads: int, size: int) -> list[torch.Tensor]:
    """Views of qkv_P (slots, 3 * heads * size): each group's q, k and v as (n, heads, t, size), groups in order."""
    out, start = [], 0
    for n, t in shapes:
        z = qkv_P[start:start + n * t].view(n, t, 3, heads, size)
        out += [z[:, :, i].transpose(1, 2) for i in range(3)]
        start += n * t
    return out


def group_heads(qkv_P: torch.Tensor, packed, heads: int, size: int) -> list[tuple[torch.Tensor, ...]]:
    """[(q, k, v)] of every attention group of ``packed``, each (n, heads, t, size), from the fused projections in
    the groups' slots (qkv_P: (P, 3 * heads * size), ``gather_slots``). Views, as the split, view, permute and
    unbind they replace; eagerly their backward writes the gradients of all groups' q, k and v into one (P, 3 *
    heads * size) tensor, one copy where autograd's unbind, reshape and split backwards made three; traced, each
    group's three stacked and the groups concatenated (``_GroupHeadsTraced``)."""
    packed.check_layout()
    shapes = tuple((g.num_rows, g.length) for g in packed.groups)
    views = (_GroupHeadsTraced if torch.compiler.is_compiling() else _GroupHeads).apply(qkv_P, shapes, heads, size)
    return [tuple(views[i:i + 3]) for i in range(0, len(views), 3)]


def gather_unique(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` for an ``index`` without repeats (not checked: a host-built index)."""
    return _GatherUnique.apply(x, index)


def gather_slots(x_N: torch.Tensor, packed) -> torch.Tensor:
    """x_P...: the rows of x_N (stream order) in every attention group's slots, groups end to end
    (``Packed.gather_P``); backward assumes zero gradient on the padding slots (see the module docstring)."""
    if packed.gather_P is None:  # the stream is its slots (packing.padded_stream)
        return x_N
    return _GatherSlots.apply(x_N, packed.gather_P, packed.back_N)
