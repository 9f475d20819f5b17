"""train.fast_dropout (model/dropout.py): CPU dropout masks from 16 bits of a counter's hash per element.

The masks are checked statistically (rate per position within a 64-bit word, independence of neighbours, the
exact scale), their words against SplitMix64 in Python integers, the C kernel bit for bit against the torch
reference, the attention-probability path against a float64 reference built from the same mask, and the model
switch by the ops it dispatches (no ``bernoulli_`` with it on, torch's dropout with it off). The tests below the
size threshold's own run with it at 0, so that their small tensors take this module's path.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_trim_last_layer import _batch, _module

from pretrain.metrics.op_count import OpCounter
from pretrain.model import dropout as dropout_module
from pretrain.model.kernels import cpu_kernels
from pretrain.model.dropout import (GAMMA, LEVELS, Mask, _DropScale, _probs, _probs_grad, attention, draw, draw_masks,
                                    dropout, keep_mask, kept_of, mask_words, scale_masked, sdpa_bias, set_fast_dropout,
                                    uses_fast)
from pretrain.training.step import dropout_rng, host_facts

N = 1 << 20


FAST_MIN_NUMEL = dropout_module.FAST_MIN_NUMEL
"""The module's own threshold (the fixture below sets it to 0)."""


@pytest.fixture(autouse=True)
def no_size_threshold(monkeypatch):
    """Every tensor takes the fast path, however small (the threshold's own test puts it back)."""
    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 0)


def _aten_ops(fn) -> dict[str, int]:
    with OpCounter() as c:
        fn()
    return {name.split(".")[1]: n for name, n in c.ops.items() if name.startswith("aten.")}


def test_tensors_under_the_size_threshold_get_torchs_dropout(monkeypatch):
    """A tensor (or attention probabilities) of FAST_MIN_NUMEL elements draws its mask here, one element fewer gets
    torch's Bernoulli dropout; the attention's count is that of its probabilities (rows x keys), not of q."""
    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", FAST_MIN_NUMEL)
    limit = FAST_MIN_NUMEL
    assert 1 << 12 < limit <= 1 << 17  # where fast and torch's cross on a CPU (docs/performance.md)
    for n, fast in ((limit, True), (limit - 1, False)):
        x = torch.randn(n, requires_grad=True)
        assert uses_fast(x, 0.1, True, True) is fast
        ops = _aten_ops(lambda: dropout(x, 0.1).sum().backward())
        assert (ops.get("random_", 0) > 0, ops.get("bernoulli_", 0) > 0) == (fast, not fast)
    k = torch.randn(2, 2, 64, 8)
    for rows, fast in ((limit // 256, True), (limit // 256 - 1, False)):  # probabilities: 2 x 2 x rows x 64
        q = torch.randn(2, 2, rows, 8)
        assert q.numel() < limit
        ops = _aten_ops(lambda: attention(q, k, k, None, 0.1))
        assert (ops.get("random_", 0) > 0, ops.get("bernoulli_", 0) > 0) == (fast, not fast)


def _sigmas(count: float, n: int, q: float) -> float:
    """How many binomial standard deviations ``count`` is from n * q."""
    return abs(count - n * q) / (n * q * (1 - q)) ** 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-3])
def test_drop_rate_and_scale_are_exact(p):
    torch.manual_seed(0)
    q = round(p * LEVELS) / LEVELS  # the drop probability the 16 bits can express
    y = dropout(torch.ones(N), p)
    kept = y != 0
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / (1 - q)))  # kept values scaled by the exact inverse
    assert _sigmas(float((~kept).sum()), N, q) < 5
    # Each of the four 16-bit elements of a 64-bit draw drops at the rate (a draw whose top bit is always 0, as
    # ``random_()`` without a range gives, would never drop the fourth).
    for j in range(4):
        assert _sigmas(float((~kept).view(-1, 4)[:, j].sum()), N // 4, q) < 5


def test_neighbouring_masks_are_uncorrelated():
    torch.manual_seed(1)
    kept, _ = keep_mask((N,), 0.3, "cpu")
    dropped = ~kept
    d = dropped.double() - dropped.double().mean()
    for lag in (1, 2, 3, 4, 5, 8):
        corr = float((d[lag:] * d[:-lag]).mean() / d.var())
        assert abs(corr) < 5 / N ** 0.5, (lag, corr)


def test_masks_follow_the_generator():
    x = torch.randn(64, 33)
    torch.manual_seed(3)
    a = dropout(x, 0.2)
    torch.manual_seed(3)
    b = dropout(x, 0.2)
    torch.manual_seed(4)
    c = dropout(x, 0.2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with dropout_rng(seed=0, step=5, rank=1, device=torch.device("cpu")):
        d = dropout(x, 0.2)
    with dropout_rng(seed=0, step=5, rank=1, device=torch.device("cpu")):
        e = dropout(x, 0.2)
    assert torch.equal(d, e)


def test_the_step_seed_draws_as_torch_manual_seed_and_restores_the_state():
    """On the CPU ``seeded_rng`` seeds the CPU generator alone (no lazy CUDA seed with its recorded stack): the same
    draws as ``torch.manual_seed``, and the global state outside is as it was."""
    from pretrain.training.step import seeded_rng

    torch.manual_seed(11)
    before = torch.get_rng_state()
    with seeded_rng(2**40 + 7, "cpu"):
        ours = torch.rand(64)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(2**40 + 7)
    assert torch.equal(ours, torch.rand(64))
    with dropout_rng(seed=0, step=5, rank=1, device="cpu"):
        keyed = torch.rand(8)
    torch.manual_seed((0 * 1_000_003 + 5 * 1009 + 1) % (2**63))
    assert torch.equal(keyed, torch.rand(8))


def test_forward_and_backward_against_the_mask():
    torch.manual_seed(5)
    x = torch.randn(257, 31, dtype=torch.float64, requires_grad=True)
    w = torch.randn(257, 31, dtype=torch.float64)
    torch.manual_seed(6)
    y = dropout(x, 0.25)
    torch.manual_seed(6)
    kept, scale = keep_mask(x.shape, 0.25, "cpu")
    keep = kept.double()
    assert torch.equal(y, x.detach() * keep * scale)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w * keep * scale)


def test_the_backward_keeps_nothing():
    """No mask is saved for the backward (it is computed again from the key), and the gradient is right."""
    saved = []
    x = torch.randn(40, 50, requires_grad=True)
    torch.manual_seed(2)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.shape)) or t, lambda t: t):
        y = dropout(x * 1.0, 0.1)
    assert saved == []
    y.backward(torch.ones_like(y))
    torch.manual_seed(2)
    kept, scale = keep_mask(x.shape, 0.1, "cpu")
    assert torch.equal(x.grad, kept.float() * scale)


def _splitmix64(key: int, word: int) -> int:
    """SplitMix64's output for counter ``word`` in Python's integers, mod 2^64 (the slow reference)."""
    z = (key + word * GAMMA) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_mask_words_are_splitmix64():
    """torch's int64 arithmetic (wrapping, logical shifts from masked arithmetic ones) gives SplitMix64's words,
    for keys with and without the top bit and words far along."""
    for key, first in ((0, 0), (2**64 - 1, 5), (0x0123456789ABCDEF, 2**40), (0xFEDCBA9876543210, 123)):
        words = mask_words(key, first, 9).tolist()
        assert [w % 2**64 for w in words] == [_splitmix64(key, first + i) for i in range(9)]


def _kernel():
    kernel = dropout_module.cpu_kernels()
    if kernel is None:
        if shutil.which("cc") or shutil.which("gcc"):
            pytest.fail("pretrain.model._kernels is not built although a C compiler is here: pip install -e .")
        pytest.skip("no C compiler: the dropout kernel is not built")
    return kernel


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so -0.0 is not 0.0), except that a NaN's payload is free (torch's vectorised bf16
    rounding writes 0xFFFF, its scalar one 0x7FC0)."""
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_is_the_torch_reference_bit_for_bit(dtype):
    """``scale_masked`` through the C kernel equals ``kept_of``'s mask applied by torch's multiplies, bit for bit:
    sizes that end inside a 16-word block and a word, masks starting at a later word, a size split over threads
    (the same bits with 1 and 2 threads), a strided input, and non-finite inputs (a dropped one stays NaN)."""
    kernel = _kernel()
    gen = torch.Generator().manual_seed(13)
    # (1 << 18) + 1 and 3 * (1 << 16) + 1: n // threads a multiple of the 64-element block, and a remainder (the
    # threads' runs must still cover the last element)
    for n, first in ((1, 0), (63, 0), (64, 3), (1001, 17), ((1 << 19) + 5, 2**33), ((1 << 18) + 1, 0),
                     (3 * (1 << 16) + 1, 5)):
        x = torch.randn(n, generator=gen).to(dtype)
        x[: min(n, 40):7] = float("nan")
        x[3: min(n, 40):9] = float("inf")
        drop = round(0.3 * LEVELS)
        mask = Mask(0x9E3779B97F4A7C15 ^ n, first, drop - LEVELS // 2, LEVELS / (LEVELS - drop))
        ref = x.mul(kept_of(mask, x.shape).view(torch.uint8)).mul_(mask.scale)
        for threads in (1, 2, 3):
            y = torch.empty_like(x)
            kernel.scale_masked(x.data_ptr(), y.data_ptr(), n, {torch.float32: 0, torch.bfloat16: 1}[dtype],
                                mask.key, mask.first, mask.threshold, mask.scale, threads)
            assert _same_bits(y, ref), (n, first, threads)
        assert _same_bits(scale_masked(x, mask), ref)
    x = torch.randn(37, 64, generator=gen).to(dtype)
    mask = Mask(7, 0, -26214, 1.25)
    ref = x.t().contiguous().mul(kept_of(mask, (64, 37)).view(torch.uint8)).mul_(1.25)
    assert torch.equal(scale_masked(x.t(), mask), ref)


def test_a_step_runs_under_the_profilers_record_shapes():
    """``torch.profiler`` with ``record_shapes`` records an autograd function's arguments as C++ values: a key
    beyond int64 (half of all keys, when they were held unsigned) failed the step there. Keys are signed; the
    kernel reads the same bits, so a key and its unsigned form give the same mask."""
    torch.manual_seed(5)
    x = torch.randn(1 << 14, requires_grad=True)
    keys = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True):
        for _ in range(12):
            mask = draw(0.1)
            keys.append(mask.key)
            _DropScale.apply(x, mask).sum().backward()
    assert min(keys) < 0 <= max(keys) and all(-2**63 <= k < 2**63 for k in keys)
    unsigned = Mask(min(keys) % 2**64, 3, mask.threshold, mask.scale)
    assert torch.equal(scale_masked(x.detach(), unsigned), scale_masked(x.detach(), unsigned._replace(key=min(keys))))


def test_without_the_kernel_the_same_masks(monkeypatch):
    """Where the C kernel is not built, the torch reference gives the same forward and gradient."""
    x = torch.randn(300, 41, requires_grad=True)
    torch.manual_seed(14)
    y = dropout(x, 0.2)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    monkeypatch.setattr(dropout_module, "cpu_kernels", lambda: None)
    torch.manual_seed(14)
    y2 = dropout(x, 0.2)
    (g2,) = torch.autograd.grad(y2.square().sum(), x)
    assert torch.equal(y, y2) and torch.equal(g, g2)


def test_off_cases_run_torch_dropout():
    x = torch.randn(8, 8)
    assert not uses_fast(x, 0.1, False, True)  # eval
    assert not uses_fast(x, 0.0, True, True) and not uses_fast(x, 1.0, True, True)
    # p that 16 bits round to 0 or to 1: torch's dropout (no dropout at all, or a scale of 1 / 0)
    assert not uses_fast(x, 1e-6, True, True) and not uses_fast(x, 1 - 1e-6, True, True)
    assert not uses_fast(x, 0.1, True, False)
    assert not uses_fast(torch.empty(8, device="meta"), 0.1, True, True)  # not a CPU tensor: torch's kernel
    assert torch.equal(dropout(x, 0.1, training=False), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_attention_equals_the_float64_reference(mask_kind):
    """Scores, masked softmax, the probabilities' dropout with ``keep_mask``'s mask, values: output and gradients."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 2, 9, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.rand(3, 1, 1, 9, generator=gen) > 0.3
    keep[..., 0] = True
    mask = {"bool": keep, "float": torch.where(keep, 0.0, -1e4).double(), "none": None}[mask_kind]
    torch.manual_seed(8)
    y = attention(q, k, v, mask, 0.2)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (q, k, v), g)
    torch.manual_seed(8)
    kept, scale = keep_mask((3, 2, 9, 9), 0.2, "cpu")
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    if mask_kind == "bool":
        scores = scores.masked_fill(~keep, float("-inf"))
    elif mask_kind == "float":
        scores = scores + mask
    ref = (scores.softmax(-1) * kept.double() * scale) @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    assert (y - ref).abs().max() < 1e-12
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() < 1e-12
    # Without dropout, SDPA itself.
    assert torch.equal(attention(q, k, v, mask, 0.0), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))



@pytest.mark.parametrize("fast_path", [True, False])
def test_a_query_scaled_beforehand_gives_the_same_attention(fast_path, monkeypatch):
    """``q_scaled``: q multiplied by 1/sqrt(K) already (ModernBERT's RoPE tables carry it on the CPU); this
    module's path and SDPA's (a tensor under the size threshold) skip their own factor: float64, output and
    gradients equal the unscaled call's."""
    if not fast_path:
        monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", 1 << 40)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 1, 7, generator=gen) > 0.3
    keep[..., 0] = True
    p = 0.2 if fast_path else 0.0  # SDPA's own dropout would draw other masks than this module's
    torch.manual_seed(12)
    y = attention(q * 8 ** -0.5, k, v, keep, p, q_scaled=True)
    torch.manual_seed(12)
    ref = attention(q, k, v, keep, p)
    g = torch.randn_like(y)
    grads, ref_grads = torch.autograd.grad(y, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
    assert (y - ref).abs().max() < 1e-12
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(grads, ref_grads))
    assert (attention(q, k, v, keep, p, q_scaled=True) - ref).abs().max() > 1e-3  # the factor matters


class _AttentionProbs(torch.autograd.Function):
    """The C probabilities (``dropout._probs`` forward, ``dropout._probs_grad`` backward) as an autograd function of
    the scores: what the attention node computes between its two matmuls."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, keep: torch.Tensor | None, scale: float, mask: Mask) -> torch.Tensor:
        probs, dropped, keep = _probs(scores, keep, scale, mask)
        ctx.save_for_backward(probs, keep)
        ctx.scale, ctx.mask = scale, mask
        return dropped

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, keep = ctx.saved_tensors
        return _probs_grad(grad, probs, keep, ctx.scale, ctx.mask), None, None, None


def _probs_reference(scores: torch.Tensor, keep: torch.Tensor | None, scale: float, mask: Mask) -> torch.Tensor:
    """The C probabilities in float64 torch ops: scaled scores, masked keys at float32's lowest, softmax, dropout."""
    x = scores.double() * scale
    if keep is not None:
        x = x.masked_fill(~keep, torch.finfo(torch.float32).min)
    return x.softmax(-1) * kept_of(mask, scores.shape).double() * mask.scale


@pytest.mark.parametrize("mask_kind", ["none", "keys", "band"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attention_probabilities_in_c_equal_the_float64_reference(mask_kind, threads):
    """The C kernel's scale, key mask, softmax and dropout (``dropout._probs``) and their backward against float64:
    rows that do not start on a mask word (odd lengths), a mask starting at a later word, a row with no key to
    attend to (weights over all, as ``masked_fill`` gives), a banded (n, 1, t, t) mask, split over threads. The
    dropped elements are those of ``kept_of``'s mask, exactly."""
    _kernel()
    gen = torch.Generator().manual_seed(31)
    n, heads, t = 8, 4, 109
    scores = (3 * torch.randn(n, heads, t, t, generator=gen)).requires_grad_()
    keep = None
    if mask_kind == "keys":
        keep = torch.rand(n, 1, 1, t, generator=gen) > 0.3
        keep[2] = False
    elif mask_kind == "band":
        i = torch.arange(t)
        keep = ((i[:, None] - i[None, :]).abs() <= 9).expand(n, 1, t, t) & (torch.rand(n, 1, 1, t, generator=gen) > 0.2)
    mask = Mask(-0x0123456789ABCDEF, 5, round(0.25 * LEVELS) - LEVELS // 2, LEVELS / (LEVELS - round(0.25 * LEVELS)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = _AttentionProbs.apply(scores, keep, 0.125, mask)
        g = torch.randn(y.shape, generator=gen)
        (grad,) = torch.autograd.grad(y, scores, g)
    finally:
        torch.set_num_threads(before)
    s64 = scores.detach().double().requires_grad_()
    ref = _probs_reference(s64, keep, 0.125, mask)
    (ref_grad,) = torch.autograd.grad(ref, s64, g.double())
    assert torch.equal(y == 0, ref == 0)  # the same elements dropped (and masked)
    assert (y.double() - ref).abs().max() < 1e-6 * ref.abs().max()
    assert (grad.double() - ref_grad).abs().max() < 1e-5 * ref_grad.abs().max()
    if mask_kind == "keys":  # the row with no key: uniform weights before dropout, no gradient
        assert torch.allclose(ref[2][ref[2] > 0], torch.tensor(mask.scale / t, dtype=torch.float64))
        assert not grad[2].any()


def test_attention_probabilities_in_c_keep_non_finite_scores_seen():
    """A NaN score makes its row's probabilities NaN (as torch's softmax does); an infinite score gives NaN too;
    the other rows are untouched."""
    _kernel()
    scores = torch.randn(1, 2, 5, 16)
    scores[0, 0, 1, 3] = float("nan")
    scores[0, 1, 4, 0] = float("inf")
    y = _AttentionProbs.apply(scores, None, 1.0, Mask(3, 0, -LEVELS // 2, 1.0))  # keeps every element
    bad = torch.zeros(1, 2, 5, dtype=torch.bool)
    bad[0, 0, 1] = bad[0, 1, 4] = True
    assert y[bad].isnan().all() and not y[~bad].isnan().any()
    assert torch.allclose(y[~bad], scores[~bad].softmax(-1))


def test_attention_takes_the_c_probabilities_in_fp32(monkeypatch):
    """``attention`` in fp32 with dropout takes the C probabilities (bool masks of every shape the model passes, a
    strided one, or none) and gives what its torch path gives with the same mask; a float mask or float64 takes
    the torch path."""
    _kernel()
    taken = []
    in_c = dropout_module._probs_in_c
    monkeypatch.setattr(dropout_module, "_probs_in_c", lambda *a: taken.append(in_c(*a)) or taken[-1])
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(4, 3, 33, 16, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.rand(4, 1, 1, 33, generator=gen) > 0.2
    g = torch.randn(4, 3, 33, 16, generator=gen)
    strided = torch.stack([keep, ~keep], -1)[..., 0]  # keys two bytes apart
    for mask in (keep, None, keep.expand(4, 1, 33, 33), strided):
        out = []
        for torch_path in (False, True):
            if torch_path:
                monkeypatch.setattr(dropout_module, "cpu_kernels", lambda: None)
            torch.manual_seed(42)
            y = attention(q, k, v, mask, 0.3)
            out.append((y, *torch.autograd.grad(y, (q, k, v), g)))
            monkeypatch.setattr(dropout_module, "cpu_kernels", cpu_kernels)
        for a, b in zip(*out):
            assert (a - b).abs().max() < 1e-5 * b.abs().max()
    assert taken == [True, False] * 4
    attention(q, k, v, torch.where(keep, 0.0, -1e4), 0.3)
    attention(q.double(), k.double(), v.double(), keep, 0.3)
    assert taken[8:] == [False, False]


def test_the_attention_node_is_autograds_chain_bit_for_bit():
    """``_Attention`` (the two matmuls around the C probabilities as one autograd node) gives the output and the
    gradients that autograd gives through q k^T, ``_AttentionProbs`` and the product with v, bit for bit, for
    contiguous inputs and for the strided views of a fused projection, with v's gradient not asked for; k's
    gradient comes contiguous (autograd's was a transposed view, which the groups' layout copied)."""
    _kernel()
    gen = torch.Generator().manual_seed(43)
    n, h, t, k_size = 3, 4, 29, 16
    fused = torch.randn(n, t, h, 3 * k_size, generator=gen)
    layouts = {"contiguous": [torch.randn(n, h, t, k_size, generator=gen) for _ in range(3)],
               "strided": [fused[..., i * k_size:(i + 1) * k_size].transpose(1, 2) for i in range(3)]}
    keep = torch.rand(n, 1, 1, t, generator=gen) > 0.25
    g = torch.randn(n, h, t, k_size, generator=gen)
    for layout, tensors in layouts.items():
        for v_grad in (True, False):
            q, k, v = (x.detach().requires_grad_(i < 2 or v_grad) for i, x in enumerate(tensors))
            mask = draw(0.2)
            y = dropout_module._Attention.apply(q, k, v, keep, 0.25, mask)
            wrt = (q, k, v) if v_grad else (q, k)
            grads = torch.autograd.grad(y, wrt, g)
            y_ref = _AttentionProbs.apply(q @ k.transpose(-2, -1), keep, 0.25, mask) @ v
            refs = torch.autograd.grad(y_ref, wrt, g)
            assert torch.equal(y, y_ref), layout
            assert all(torch.equal(a, b) for a, b in zip(grads, refs)), layout
            assert grads[1].is_contiguous() and not refs[1].is_contiguous()
            assert y.abs().max() > 0 and all(a.abs().max() > 0 for a in grads)


def test_a_layers_group_masks_are_one_draw():
    """``draw_masks``: the masks of several tensors are consecutive runs of one key's words (each starting on a
    word), each at the rate; ``attention`` with such a mask (``kept=``) is the float64 reference with it, whatever
    the tensor's size (the threshold is not asked)."""
    shapes = [(3, 2, 9, 9), (5, 2, 4, 4), (1, 2, 30, 30)]
    numels = [a * b * c * d for a, b, c, d in shapes]
    torch.manual_seed(21)
    masks = draw_masks(numels, 0.3)
    torch.manual_seed(21)
    (whole,) = draw_masks([1], 0.3)
    assert {m.key for m in masks} == {whole.key} and {m.scale for m in masks} == {whole.scale}
    words = [(n + 3) // 4 for n in numels]
    all_kept = kept_of(whole, (4 * sum(words),))
    start = 0
    for m, shape, n, w in zip(masks, shapes, numels, words):
        assert m.first == start // 4
        assert torch.equal(kept_of(m, shape).reshape(-1), all_kept[start:start + n])
        start += 4 * w
    torch.manual_seed(22)
    big = [kept_of(m, (N // 2,)) for m in draw_masks([N // 2, N // 2], 0.3)]
    q = round(0.3 * LEVELS) / LEVELS
    assert all(_sigmas(float((~m).sum()), N // 2, q) < 5 for m in big)
    gen = torch.Generator().manual_seed(23)
    q_, k, v = (torch.randn(3, 2, 9, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    y = attention(q_, k, v, None, 0.3, kept=masks[0])
    ref = ((q_ @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1) * kept_of(masks[0], shapes[0]).double()
           * masks[0].scale) @ v
    assert (y - ref).abs().max() < 1e-12


def test_an_unpadded_layer_draws_its_attention_masks_once(monkeypatch):
    """The unpadded path's attention groups take their masks from one draw per layer and pass (``group_masks``), not
    one per group: a training forward with attention dropout draws (``random_``) the layers x passes more than one
    without it, however many groups; the small groups included (the size threshold back at its value)."""
    monkeypatch.setattr(dropout_module, "FAST_MIN_NUMEL", FAST_MIN_NUMEL)
    batch = host_facts(_batch(), unpadded=True)
    groups = len(batch["packed_mlm"].groups) + len(batch["packed_views"].groups)
    assert groups > 2

    def draws(attention_dropout: float) -> dict[str, int]:
        module = _module(False, dropout=0.1, attention_dropout=attention_dropout, num_layers=3)
        module.train()
        return _aten_ops(lambda: module(batch))

    on, off = draws(0.1), draws(0.0)
    assert on.get("random_", 0) - off.get("random_", 0) == 3 * 2  # 3 layers, the MLM rows' and the views' passes
    assert on.get("bernoulli_", 0) == off.get("bernoulli_", 0)  # no group fell back to SDPA's own dropout
    assert on.get("_softmax", 0) > off.get("_softmax", 0)  # ...but ran this module's math path

def test_low_precision_attention_is_computed_in_fp32():
    """bf16 in, bf16 out, the arithmetic in fp32 as SDPA's CPU math path does: equal to the fp32 computation under
    the same mask, cast."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen).bfloat16() for _ in range(3))
    torch.manual_seed(10)
    y = attention(q, k, v, None, 0.1)
    torch.manual_seed(10)
    ref = attention(q.float(), k.float(), v.float(), None, 0.1)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16())
    torch.manual_seed(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attention(q, k, v, None, 0.1), y)


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_model_switch(arch):
    """A training step draws no Bernoulli sample with fast dropout (its masks are ``random_`` draws) and torch's
    dropout (embeddings, layers, attention probabilities) with it off."""
    kw = dict(arch="modernbert", pooler=False, local_window=16, layer_norm_eps=1e-5) if arch == "modernbert" else {}
    module = _module(False, dropout=0.1, attention_dropout=0.1, num_layers=3, **kw)
    module.train()
    batch = host_facts(_batch(), unpadded=True)

    def ops():
        return _aten_ops(lambda: module(batch)[0].backward())

    switches = [m for m in module.modules() if hasattr(m, "fast_dropout")]
    assert len(switches) >= 2 * 3 + 1  # per layer the dropout and the attention, and the embeddings'
    on = ops()
    set_fast_dropout(module, False)
    assert not any(m.fast_dropout for m in switches)
    off = ops()
    assert on.get("bernoulli_", 0) == 0 and on.get("random_", 0) > 0
    assert off.get("bernoulli_", 0) > 0 and off.get("random_", 0) == 0
    module.eval()
    assert "random_" not in ops()


def test_the_attention_node_with_fewer_queries_than_keys_matches_float64():
    """A trimmed last layer's kept rows (attention.SelfAttention._attend_rows) attend with m < t query rows: the C
    probabilities and the node's products on (n, H, m, t) scores against float64, a key mask on one row."""
    fd = dropout_module
    gen = torch.Generator().manual_seed(0)
    n, h, m, t, k = 3, 2, 5, 9, 8
    q, key, v = (torch.randn(n, h, r, k, generator=gen, requires_grad=True) for r in (m, t, t))
    keep = torch.ones(n, 1, 1, t, dtype=torch.bool)
    keep[1, ..., 6:] = False
    assert fd._probs_in_c(q, key, v, keep)
    y = fd._Attention.apply(q, key, v, keep, k ** -0.5, fd.draw(0.0))
    g = torch.randn(y.shape, generator=gen)
    got = (y, *torch.autograd.grad(y, (q, key, v), g))
    ref = [z.detach().double().requires_grad_() for z in (q, key, v)]
    y_ref = ((ref[0] @ ref[1].transpose(-2, -1)) * k ** -0.5).masked_fill(~keep, float("-inf")).softmax(-1) @ ref[2]
    want = (y_ref, *torch.autograd.grad(y_ref, ref, g.double()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_shape", [(5, 1, 1, 13), (4, 1, 11, 11), (3, 1, 1, 16)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_sdpa_takes_a_masks_bias_as_it_takes_the_mask(dtype, mask_shape, p):
    """``sdpa_bias``: the additive bias SDPA would make of a boolean mask (0 / -inf in the dtype), its strides but
    the last multiples of 8 (the last 1); SDPA's output and gradients with it are those with the boolean mask, bit
    for bit (CPU: the flash path without dropout, the math path with it), key masks and full (t, t) masks alike."""
    gen = torch.Generator().manual_seed(0)
    n, t = mask_shape[0], mask_shape[-1]
    q, k, v = (torch.randn(n, 2, t, 8, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.rand(mask_shape, generator=gen) > 0.4
    mask[..., 0] = True
    bias = sdpa_bias(mask, dtype)
    assert bias.dtype == dtype and bias.shape == mask.shape and bias.stride(-1) == 1
    assert all(stride % dropout_module.BIAS_ALIGNMENT == 0 for stride in bias.stride()[:-1])
    assert torch.equal(bias, torch.zeros((), dtype=dtype).masked_fill(~mask, float("-inf")).expand(mask.shape))
    runs = []
    for m in (mask, bias):
        torch.manual_seed(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
        runs.append((y, *torch.autograd.grad(y, (q, k, v), torch.ones_like(y))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_masks_bias_is_made_once_and_lives_as_long_as_the_mask():
    """The bias is cached per mask tensor: the same object for a second layer; a new one for another dtype, after the
    mask changes in place, or under inference mode; None and float masks pass as they are; the cache lets go of a
    mask that is gone (a long run keeps no step's masks)."""
    mask = torch.tensor([[[[True, True, False]]], [[[True, False, False]]]])
    bias = sdpa_bias(mask, torch.bfloat16)
    assert sdpa_bias(mask, torch.bfloat16) is bias
    assert sdpa_bias(mask, torch.float32).dtype == torch.float32
    mask[1, ..., 1:] = True
    assert torch.equal(sdpa_bias(mask, torch.float32), torch.zeros(()).masked_fill(~mask, float("-inf")))
    with torch.inference_mode():
        assert sdpa_bias(mask, torch.float32).is_inference()
    assert not sdpa_bias(mask, torch.float32).is_inference()
    assert sdpa_bias(None, torch.float32) is None
    assert sdpa_bias(bias, torch.bfloat16) is bias
    live = len(dropout_module._BIASES)
    del mask
    assert len(dropout_module._BIASES) == live - 1


def test_attention_converts_a_mask_once_for_every_layer(monkeypatch):
    """Off the C path (torch's dropout: CUDA's path) ``attention`` hands SDPA the mask's cached bias: over two
    layers' calls with one mask, SDPA converts no boolean mask (its ``where``) and the bias is filled once; without
    the cache, SDPA converts it on every call."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 6, 4, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False

    def ops():
        with OpCounter() as counter:
            for _ in range(2):
                attention(q, k, v, mask, 0.1, fast=False).sum().backward()
        return counter.ops

    cached = ops()
    assert cached["aten.where"] == 0 and cached["aten.masked_fill_"] == 1
    monkeypatch.setattr(dropout_module, "sdpa_bias", lambda mask, dtype: mask)
    assert ops()["aten.where"] == 2
