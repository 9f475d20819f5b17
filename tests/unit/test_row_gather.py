"""model/gather.py: the gathers whose backward copies give index_select's gradients (float64), also compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.model.gather import gather_slots, gather_unique
from pretrain.model.packing import pack


def _grads(fn, x, upstream):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("trailing", [(), (5,), (3, 4)])
def test_gather_unique_gives_index_selects_gradient(trailing):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((40, *trailing), dtype=torch.float64, generator=gen)
    index = torch.randperm(40, generator=gen)[:23]  # a subset, shuffled: rows not gathered get zero gradient
    upstream = torch.randn((23, *trailing), dtype=torch.float64, generator=gen)
    want_y, want_g = _grads(lambda t: t.index_select(0, index), x, upstream)
    got_y, got_g = _grads(lambda t: gather_unique(t, index), x, upstream)
    assert torch.equal(got_y, want_y)
    assert torch.equal(got_g, want_g)
    assert (got_g[torch.tensor([i for i in range(40) if i not in set(index.tolist())])] == 0).all()


def _packed():
    lengths = [9, 2, 7, 9, 4, 8, 1, 9, 3]
    mask = np.arange(9)[None, :] < np.array(lengths)[:, None]
    ids = np.where(mask, 7, 0)
    packed = pack([(ids, mask)])
    assert any(g.keep_n11t is not None for g in packed.groups)  # some group has padding slots
    return packed


def _padding_slots(packed) -> torch.Tensor:
    real = torch.zeros(packed.gather_P.shape[0], dtype=torch.bool)
    real[packed.back_N] = True
    return ~real


def test_gather_slots_gives_index_selects_gradient_when_padding_slots_get_none():
    packed = _packed()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(packed.num_tokens, 6, dtype=torch.float64, generator=gen)
    upstream = torch.randn(packed.gather_P.shape[0], 6, dtype=torch.float64, generator=gen)
    upstream[_padding_slots(packed)] = 0.0  # as attention leaves them (see model/gather.py)
    want_y, want_g = _grads(lambda t: t.index_select(0, packed.gather_P), x, upstream)
    got_y, got_g = _grads(lambda t: gather_slots(t, packed), x, upstream)
    assert torch.equal(got_y, want_y)
    torch.testing.assert_close(got_g, want_g, rtol=0, atol=0)


def test_gather_slots_relies_on_the_padding_slots_getting_no_gradient():
    """The assumption is real: a gradient on a padding slot (which attention never gives) would be dropped."""
    packed = _packed()
    x = torch.randn(packed.num_tokens, 6, dtype=torch.float64)
    upstream = torch.ones(packed.gather_P.shape[0], 6, dtype=torch.float64)
    _, want_g = _grads(lambda t: t.index_select(0, packed.gather_P), x, upstream)
    _, got_g = _grads(lambda t: gather_slots(t, packed), x, upstream)
    assert not torch.equal(got_g, want_g)


def test_attention_leaves_padding_slots_without_gradient():
    """What gather_slots relies on, through the packed attention of a real layer (fp64): the stream gathered into
    the slots (once, before the q/k/v projections) gets no gradient on a padding slot."""
    from pretrain.config import ModelConfig
    from pretrain.model.attention import SelfAttention

    packed = _packed()
    cfg = ModelConfig(vocab_size=20, hidden_size=8, num_layers=1, num_heads=2, ffn_size=16, max_position=16,
                      dropout=0.0, attention_dropout=0.0)
    attn = SelfAttention(cfg).double()
    x = torch.randn(packed.num_tokens, 8, dtype=torch.float64, requires_grad=True)
    seen = []

    def keep_grad(t):
        t.register_hook(seen.append)
        return t

    import pretrain.model.attention as attention_mod

    real = attention_mod.gather_slots
    try:
        attention_mod.gather_slots = lambda z, p: keep_grad(z.index_select(0, p.gather_P))
        attn(x, None, packed).sum().backward()
    finally:
        attention_mod.gather_slots = real
    assert len(seen) == 1  # the stream, gathered before the projections
    for g in seen:
        assert g[_padding_slots(packed)].abs().max() == 0.0
        assert g[~_padding_slots(packed)].abs().max() > 0.0


def test_both_gathers_compile_without_a_graph_break():
    packed = _packed()
    index = torch.tensor([4, 0, 7, 2])

    def f(x):
        return gather_slots(x, packed).sum() + (gather_unique(x, index) ** 2).sum()

    x = torch.randn(packed.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    f(x).backward()
    want = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def _heads_by_autograd(qkv_P, packed, heads, size):
    """What group_heads replaces: split into the groups, view, permute and unbind."""
    return [z.view(g.num_rows, g.length, 3, heads, size).permute(2, 0, 3, 1, 4).unbind(0)
            for g, z in zip(packed.groups, packed.split_groups(qkv_P))]


def _group_heads_case(seed: int, unused):
    """The packed groups, 2 heads of size 3, fused projections in the slots (float64) and a loss over every
    group's q, k and v (each times a random tensor), leaving out ``unused`` = (group, 0 q / 1 k / 2 v)."""
    packed, heads, size = _packed(), 2, 3
    assert len(packed.groups) > 1
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(packed.group_sizes), 3 * heads * size, dtype=torch.float64, generator=gen)
    ups = [[torch.randn((g.num_rows, heads, g.length, size), dtype=torch.float64, generator=gen) for _ in range(3)]
           for g in packed.groups]

    def loss(parts):
        return sum((t * u).sum() for i, (qkv, up) in enumerate(zip(parts, ups)) for j, (t, u) in enumerate(zip(qkv, up))
                   if unused != (i, j))

    return packed, heads, size, x, loss


@pytest.mark.parametrize("unused", [None, (0, 0), (1, 2)], ids=["all read", "a q unread", "a v unread"])
def test_group_heads_gives_the_split_view_permute_unbind_gradient_in_one_copy(unused):
    """Every group's q, k and v as the views autograd's chain gives (the same strides), and the same gradient
    (float64), also where a loss reads none of some group's q or v; two aten calls a group forward (an as_strided
    and an unbind), and a backward that makes no stack and no cat and writes every part in one ``_foreach_copy_``
    (the unread parts in one ``_foreach_zero_``): the eager path off the C kernel (CUDA), ~11 calls a group
    each way before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.model.gather import group_heads

    packed, heads, size, x, loss = _group_heads_case(1, unused)
    want_x = x.clone().requires_grad_(True)
    want_parts = _heads_by_autograd(want_x, packed, heads, size)
    loss(want_parts).backward()
    got_x = x.clone().requires_grad_(True)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        got_parts = group_heads(got_x, packed, heads, size)
    assert sorted(ops) == sorted(["as_strided", "unbind"] * len(packed.groups)), ops
    for got, want in zip(got_parts, want_parts):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    total = loss(got_parts)
    ops.clear()
    with Ops():
        total.backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=0)
    assert not {"stack", "cat", "clone", "slice_backward", "select_backward", "add", "add_", "copy_"} & set(ops), ops
    assert ops.count("_foreach_copy_") == 1 and ops.count("_foreach_zero_") == (unused is not None), ops


def test_group_heads_of_strided_columns_are_the_autograd_views_and_gradient():
    """A q/k/v tensor whose columns are strided (no ``as_strided`` layout for it) gets the slice, view, select and
    transpose views and autograd's gradient (float64)."""
    from pretrain.model.gather import group_heads

    packed, heads, size, x, loss = _group_heads_case(4, None)
    want_x = x.clone().requires_grad_(True)
    loss(_heads_by_autograd(want_x, packed, heads, size)).backward()
    got_x = x.t().contiguous().t().requires_grad_(True)  # the same values, column stride != 1
    assert got_x.stride(1) != 1
    got_parts = group_heads(got_x, packed, heads, size)
    for got, want in zip(got_parts, _heads_by_autograd(x, packed, heads, size)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    loss(got_parts).backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=0)


@pytest.mark.parametrize("unused", [None, (1, 2)], ids=["all read", "a v unread"])
def test_compiled_group_heads_writes_each_gradient_once_with_the_autograd_gradient(unused):
    """In a compiled step group_heads' backward stacks each group's q/k/v gradients and concatenates the groups
    (gather._GroupHeadsTraced): the traced backward has no slice or select backward (which inductor fused into one
    kernel summing twelve zero-padded pieces per element), and the gradient is autograd's own (float64), also where
    a loss reads none of some group's v."""
    from torch._dynamo.backends.common import aot_autograd

    from pretrain.model.gather import group_heads

    packed, heads, size, x, loss = _group_heads_case(2, unused)
    want_x = x.clone().requires_grad_(True)
    loss(_heads_by_autograd(want_x, packed, heads, size)).backward()
    backward_ops = []

    def record(gm, _inputs):
        backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    got_x = x.clone().requires_grad_(True)
    compiled = torch.compile(lambda z: loss(group_heads(z, packed, heads, size)), fullgraph=True,
                             backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=record))
    compiled(got_x).backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=0)
    assert any("cat" in op for op in backward_ops), backward_ops
    assert not [op for op in backward_ops if "slice_backward" in op or "select_backward" in op
                or "slice_scatter" in op or "select_scatter" in op], backward_ops


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unused", [None, (1, 2)], ids=["all read", "a v unread"])
def test_copied_group_heads_are_the_views_values_and_gradient(dtype, unused):
    """``group_heads(..., copied=True)`` on the CPU (the C kernel, ``_GroupHeadsCopied``): every group's q, k and v
    contiguous with the views' values, and the views' gradient, bit for bit (a copy both ways), also where a loss
    reads none of some group's v; the same with 1, 2 and 3 threads."""
    from pretrain.model import gather
    from pretrain.model.gather import group_heads

    if gather.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    packed, heads, size, x, loss = _group_heads_case(3, unused)
    x = x.to(dtype)
    want_x = x.clone().requires_grad_(True)
    want_parts = group_heads(want_x, packed, heads, size)
    loss([[t.double() for t in qkv] for qkv in want_parts]).backward()
    for threads in (1, 2, 3):
        before = _threads(threads)
        try:
            got_x = x.clone().requires_grad_(True)
            got_parts = group_heads(got_x, packed, heads, size, copied=True)
            loss([[t.double() for t in qkv] for qkv in got_parts]).backward()
        finally:
            _threads(before)
        for got, want in zip(got_parts, want_parts):
            for a, b in zip(got, want):
                assert a.is_contiguous() and a.shape == b.shape and torch.equal(a, b)
        assert torch.equal(got_x.grad, want_x.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_to_slots_is_the_transposed_concatenation(dtype):
    """``heads_to_slots`` through the C kernel: every group's (n, heads, t, size) output in its slots' rows, groups
    end to end, as the transposing reshape and ``cat`` it replaces; its backward the same gradients, bit for bit;
    a size split over threads (1, 2, 3) and a strided output (a slice, as a banded layer's)."""
    from pretrain.model import gather
    from pretrain.model.gather import heads_to_slots

    if gather.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")
    packed, heads, size = _packed(), 8, 320
    gen = torch.Generator().manual_seed(4)
    ys = [torch.randn((g.num_rows, heads, g.length + 1, size), generator=gen).to(dtype)[:, :, 1:]
          for g in packed.groups]
    up = torch.randn(sum(packed.group_sizes), heads * size, generator=gen).to(dtype)

    def reference(parts):
        return torch.cat([y.transpose(1, 2).reshape(-1, heads * size) for y in parts])

    want_in = [y.clone().requires_grad_(True) for y in ys]
    want = reference(want_in)
    (want * up).sum().backward()
    assert want.numel() >= 1 << 17  # big enough for the kernel to split it over threads
    for threads in (1, 2, 3):
        before = _threads(threads)
        try:
            got_in = [y.clone().requires_grad_(True) for y in ys]
            got = heads_to_slots(got_in, packed)
            (got * up).sum().backward()
        finally:
            _threads(before)
        assert torch.equal(got, want)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(got_in, want_in))


@pytest.mark.parametrize("strided_grad", [False, True], ids=["contiguous gradient", "strided gradient"])
def test_heads_to_slots_off_the_c_kernel_is_the_transposed_concatenation(monkeypatch, strided_grad):
    """``heads_to_slots`` on the eager path off the C kernel (CUDA's, ``_HeadsToSlotsStrided``), forced on the CPU:
    the transposing reshape and ``cat`` it replaces, bit for bit (float64), and their gradients; forward one
    ``_foreach_copy_`` for all groups, backward no copy at all (each group gets its strided view of the gradient,
    also from a gradient whose columns are strided, made contiguous once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.model import gather

    monkeypatch.setattr(gather, "cpu_kernels", lambda: None)
    packed, heads, size = _packed(), 2, 3
    gen = torch.Generator().manual_seed(5)
    ys = [torch.randn((g.num_rows, heads, g.length + 1, size), dtype=torch.float64, generator=gen)[:, :, 1:]
          for g in packed.groups]
    up = torch.randn(sum(packed.group_sizes), heads * size, dtype=torch.float64, generator=gen)
    want_in = [y.clone().requires_grad_(True) for y in ys]
    want = torch.cat([y.transpose(1, 2).reshape(-1, heads * size) for y in want_in])
    (want * up).sum().backward()
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    got_in = [y.clone().requires_grad_(True) for y in ys]
    with Ops():
        got = gather.heads_to_slots(got_in, packed)
    assert torch.equal(got, want)
    assert ops.count("_foreach_copy_") == 1 and not {"cat", "clone", "copy_"} & set(ops), ops
    grad = up.t().contiguous().t() if strided_grad else up  # the same values, column stride != 1
    ops.clear()
    with Ops():  # autograd.grad: no leaf's accumulation copies counted
        grads = torch.autograd.grad(got, got_in, grad)
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, want_in))
    assert not {"cat", "split", "split_with_sizes", "_foreach_copy_", "copy_"} & set(ops), ops
    assert ops.count("clone") == strided_grad, ops
