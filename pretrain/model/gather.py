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

On the CPU (eager) the attention groups' layout moves in one pass of the C kernel ``slot_heads`` each way:
``group_heads(..., copied=True)`` copies every group's q, k and v out contiguous (BERT's attention multiplies them
as they are; ``matmul`` copied each strided view apart) and writes their gradients back; ``heads_to_slots`` lays
every group's output into the slots' rows (was a transposing copy a group and a ``cat``). Elsewhere (CUDA, eager) the
same layouts are strided views made with one ``as_strided`` a group, and the copies between them and the slots are
one ``_foreach_copy_`` a layer (``_GroupHeads``, ``_HeadsToSlotsStrided``): on a real batch's 16 groups a CUDA
step dispatched ~25 aten calls a group and layer for these, 6 now (``tools/bench_device_ops.py``).

Both gathers give the same gradients as ``index_select`` (tests/unit/test_row_gather.py, against float64 and through the
unpadded encoder's gradients in tests/unit/test_unpadded.py).
"""

from __future__ import annotations

import torch

from pretrain.model.kernels import KINDS, cpu_kernels


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
    """``group_heads`` eagerly off the C kernel (CUDA; a rotary layer): strided views of qkv_P, two aten calls a
    group (``_strided_heads``); the backward writes every group's q, k and v gradients into one tensor with one
    ``_foreach_copy_`` (and one ``_foreach_zero_`` for the parts no loss read)."""

    @staticmethod
    def forward(ctx, qkv_P: torch.Tensor, shapes: tuple[tuple[int, int], ...], heads: int, size: int):
        ctx.set_materialize_grads(False)
        ctx.shapes, ctx.heads, ctx.size = shapes, heads, size
        ctx.like = (qkv_P.shape, qkv_P.dtype, qkv_P.device)
        return tuple(_strided_heads(qkv_P, shapes, 3, heads, size))

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.like
        grad_P = torch.empty(shape, dtype=dtype, device=device)
        parts = _strided_heads(grad_P, ctx.shapes, 3, ctx.heads, ctx.size)
        read = [(z, g) for z, g in zip(parts, grads) if g is not None]
        if read:
            torch._foreach_copy_([z for z, _ in read], [g for _, g in read])
        unread = [z for z, g in zip(parts, grads) if g is None]  # an output no loss read
        if unread:
            torch._foreach_zero_(unread)
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


def _slot_heads_in_c(x: torch.Tensor) -> bool:
    """Whether the C kernel (``slot_heads``) moves ``x``'s slots or heads: an eager CPU step, fp32/bf16, not empty."""
    return (x.device.type == "cpu" and not torch.compiler.is_compiling() and x.dtype in KINDS and x.numel() > 0
            and cpu_kernels() is not None)


def _move(slots: torch.Tensor, heads_list: list[torch.Tensor], shapes, parts: int, heads: int, size: int,
          to_slots: bool) -> None:
    """``slot_heads``: the slots' (part, head, size) columns to or from each group's head-major tensors."""
    cpu_kernels().slot_heads(slots.data_ptr(), slots.stride(0), slots.element_size(), shapes, parts, heads,
                             size, tuple(z.data_ptr() for z in heads_list), int(to_slots), torch.get_num_threads())


class _GroupHeadsCopied(torch.autograd.Function):
    """``group_heads`` on the CPU (eager): each group's q, k and v copied out contiguous (n, heads, t, size) in one
    pass of the C kernel, where the attention's matmuls copied each strided view apart (``matmul`` cannot fold
    (n, heads) of a view into the slots); the backward writes the gradients back into the slots' layout in one
    pass. A gradient no loss read comes as zeros (autograd materialises it)."""

    @staticmethod
    def forward(ctx, qkv_P: torch.Tensor, shapes: tuple[tuple[int, int], ...], heads: int, size: int):
        ctx.shapes, ctx.heads, ctx.size = shapes, heads, size
        ctx.like = (qkv_P.shape, qkv_P.dtype)
        outs = [qkv_P.new_empty((n, heads, t, size)) for n, t in shapes for _ in range(3)]
        _move(qkv_P, outs, shapes, 3, heads, size, to_slots=False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype = ctx.like
        grads = [g.contiguous() for g in grads]
        grad_P = torch.empty(shape, dtype=dtype)
        _move(grad_P, grads, ctx.shapes, 3, ctx.heads, ctx.size, to_slots=True)
        return grad_P, None, None, None


class _HeadsToSlots(torch.autograd.Function):
    """Each group's attention output (n, heads, t, size) into the slots' (P, heads * size) rows, groups end to end,
    in one pass of the C kernel (was a transposing copy and a ``cat``); backward the other way."""

    @staticmethod
    def forward(ctx, shapes: tuple[tuple[int, int], ...], *ys: torch.Tensor):
        heads, size = ys[0].shape[1], ys[0].shape[3]
        ctx.shapes, ctx.heads, ctx.size = shapes, heads, size
        ys = [y.contiguous() for y in ys]
        y_PD = ys[0].new_empty((sum(n * t for n, t in shapes), heads * size))
        _move(y_PD, ys, shapes, 1, heads, size, to_slots=True)
        return y_PD

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):
        grad_PD = grad_PD.contiguous()
        grads = [grad_PD.new_empty((n, ctx.heads, t, ctx.size)) for n, t in ctx.shapes]
        _move(grad_PD, grads, ctx.shapes, 1, ctx.heads, ctx.size, to_slots=False)
        return (None, *grads)


class _HeadsToSlotsStrided(torch.autograd.Function):
    """``heads_to_slots`` eagerly off the C kernel (CUDA): every group's output copied into its strided view of
    the slots with one ``_foreach_copy_``; the backward hands each group its strided view of the gradient (what
    the transposing reshape and ``cat`` it replaces gave back, without their ~3 aten calls a group each way)."""

    @staticmethod
    def forward(ctx, shapes: tuple[tuple[int, int], ...], *ys: torch.Tensor):
        heads, size = ys[0].shape[1], ys[0].shape[3]
        ctx.shapes, ctx.heads, ctx.size = shapes, heads, size
        y_PD = ys[0].new_empty((sum(n * t for n, t in shapes), heads * size))
        torch._foreach_copy_(_strided_heads(y_PD, shapes, 1, heads, size), list(ys))
        return y_PD

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):
        if grad_PD.stride(1) != 1:
            grad_PD = grad_PD.contiguous()
        return (None, *_strided_heads(grad_PD, ctx.shapes, 1, ctx.heads, ctx.size))


def heads_to_slots(ys: list[torch.Tensor], packed) -> torch.Tensor:
    """y_PD: every attention group's output (n, heads, t, size) in its slots' rows, groups end to end."""
    shapes = packed.group_shapes
    same = all(y.dtype == ys[0].dtype for y in ys)
    if _slot_heads_in_c(ys[0]) and same:
        return _HeadsToSlots.apply(shapes, *ys)
    if same and not torch.compiler.is_compiling():
        return _HeadsToSlotsStrided.apply(shapes, *ys)
    parts = [y.transpose(1, 2).reshape(n * t, -1) for y, (n, t) in zip(ys, shapes)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _strided_heads(z_P: torch.Tensor, shapes, parts: int, heads: int, size: int) -> list[torch.Tensor]:
    """Views of z_P (slots, parts * heads * size), each group's ``parts`` pieces (q, k, v; or the one output) as
    (n, heads, t, size), groups in order: the strides ``_heads``' slice, view, select and transpose give, made with
    one ``as_strided`` a group (and an ``unbind`` for several parts). A q/k/v tensor whose columns are strided
    takes ``_heads``' views; a one-part tensor (the slots' output or its gradient) comes with unit column stride."""
    if z_P.stride(1) != 1:
        assert parts == 3, "heads_to_slots' slots are made or made contiguous with unit column stride"
        return _heads(z_P, shapes, heads, size)
    row, base, width = z_P.stride(0), z_P.storage_offset(), heads * size
    out, start = [], 0
    for n, t in shapes:
        offset = base + start * row
        if parts == 1:
            out.append(z_P.as_strided((n, heads, t, size), (t * row, size, row, 1), offset))
        else:
            out += z_P.as_strided((parts, n, heads, t, size), (width, t * row, size, row, 1), offset).unbind(0)
        start += n * t
    return out


def _heads(qkv_P: torch.Tensor, shapes, heads: int, size: int) -> list[torch.Tensor]:
    """Views of qkv_P (slots, 3 * heads * size): each group's q, k and v as (n, heads, t, size), groups in order."""
    out, start = [], 0
    for n, t in shapes:
        z = qkv_P[start:start + n * t].view(n, t, 3, heads, size)
        out += [z[:, :, i].transpose(1, 2) for i in range(3)]
        start += n * t
    return out


def group_heads(qkv_P: torch.Tensor, packed, heads: int, size: int,
                copied: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """[(q, k, v)] of every attention group of ``packed``, each (n, heads, t, size), from the fused projections in
    the groups' slots (qkv_P: (P, 3 * heads * size), ``gather_slots``). Views, as the split, view, permute and
    unbind they replace; eagerly their backward writes the gradients of all groups' q, k and v into one (P, 3 *
    heads * size) tensor, one copy where autograd's unbind, reshape and split backwards made three; traced, each
    group's three stacked and the groups concatenated (``_GroupHeadsTraced``). ``copied``: contiguous copies instead
    of views where the C kernel runs (``_GroupHeadsCopied``: for attention that multiplies them as they are; a
    rotary layer reads the views and writes head-major itself)."""
    packed.check_layout()
    shapes = packed.group_shapes
    if copied and _slot_heads_in_c(qkv_P) and qkv_P.dim() == 2 and qkv_P.stride(1) == 1:
        views = _GroupHeadsCopied.apply(qkv_P, shapes, heads, size)
    else:
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
