"""The FFN's bias and erf's GELU in one pass of the C kernel each way (model/block.py ``_BiasGelu``): values and
both gradients against float64, the bias's gradient the same for any thread count, and where it is taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.config.model import ModelConfig
from pretrain.model import block
from pretrain.model.block import FeedForward, _BiasGelu


@pytest.fixture(autouse=True)
def _built():
    if block.cpu_kernels() is None:
        pytest.skip("the C kernels are not built")


def _threads(n: int):
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return Threads()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_against_float64(dtype):
    """h = gelu(z + b) and the gradients of z and b over u = z + b from -12 to 12 (gelu underflowing towards 0 and
    equal to u), rows that end inside a 64-row block, split over threads: each within a few roundings of its
    terms' sizes (the erf approximation's absolute error, 1.5e-7, is below fp32's rounding of them)."""
    gen = torch.Generator().manual_seed(3)
    rows, width = 1000, 150  # 150k elements: split over 2 threads
    z = torch.cat([torch.linspace(-12, 12, 4000), torch.randn(rows * width - 4000, generator=gen) * 3])
    z = z.view(rows, width)
    b = torch.randn(width, generator=gen)
    w = torch.randn(rows, width, generator=gen)
    zc, bc = z.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    with _threads(2):
        h = _BiasGelu.apply(zc, bc)
        grad_z, grad_b = torch.autograd.grad(h, (zc, bc), w.to(dtype))
    assert h.dtype == grad_z.dtype == grad_b.dtype == dtype
    z64, b64 = zc.detach().double().requires_grad_(), bc.detach().double().requires_grad_()
    u = z64 + b64
    ref = F.gelu(u)
    ref_z, ref_b = torch.autograd.grad(ref, (z64, b64), w.to(dtype).double())
    eps = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    size = u.detach().abs() * (1 + z64.detach().abs() * eps / (u.detach().abs() + 1e-30))  # u's own rounding
    assert ((h.double() - ref).abs() <= 8 * eps * size + 1e-30).all()
    scale_z = w.to(dtype).double().abs() * (1 + u.detach().abs()) * (1 + z64.detach().abs())
    assert ((grad_z.double() - ref_z).abs() <= 8 * eps * scale_z).all()
    # the bias's gradient: the column sums of grad_z as rounded (float32 sums)
    sums = grad_z.double().sum(0)
    assert ((grad_b.double() - sums).abs() <= rows * 2.0 ** -23 * grad_z.double().abs().sum(0) + eps * sums.abs()).all()
    assert ((sums - ref_b).abs() <= 8 * eps * scale_z.sum(0)).all()


def test_the_bias_gradient_does_not_depend_on_the_thread_count():
    """The bias's gradient is summed over blocks of rows added in order: the same bits with 1, 2 and 3 threads (a
    resume on another machine stays exact); so are z's gradient and the forward."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(3001, 97, generator=gen).requires_grad_()
    b = torch.randn(97, generator=gen).requires_grad_()
    w = torch.randn(3001, 97, generator=gen)
    out = []
    for n in (1, 2, 3):
        with _threads(n):
            h = _BiasGelu.apply(z, b)
            out.append((h, *torch.autograd.grad(h, (z, b), w)))
    for other in out[1:]:
        assert all(torch.equal(a, c) for a, c in zip(out[0], other))


def _ffn(activation: str = "gelu") -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(ModelConfig(hidden_size=32, num_heads=2, ffn_size=64, num_layers=1, activation=activation))


def test_the_feed_forward_takes_it_in_training_only(monkeypatch):
    """A training ``FeedForward`` takes ``_BiasGelu`` on the CPU for erf's GELU, with gradients on or off (the
    contrastive cache's two passes must agree bit for bit), and gives what ``down(gelu(up(x)))`` gives; not in
    evaluation (torch's GELU, as the exported model's), not for another activation, not for a ZeRO-3 parameter
    (gathered only inside its module's call)."""
    taken = []
    apply = _BiasGelu.apply
    monkeypatch.setattr(_BiasGelu, "apply", lambda *a: taken.append(1) or apply(*a))
    ffn = _ffn()
    x = torch.randn(5, 7, 32, requires_grad=True)
    y = ffn(x)
    ref = ffn.down(F.gelu(ffn.up(x)))
    assert taken == [1] and torch.allclose(y, ref, atol=1e-6)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, *ffn.parameters()), g)
    ref_grads = torch.autograd.grad(ref, (x, *ffn.parameters()), g)
    assert all(torch.allclose(a, c, atol=1e-5) for a, c in zip(grads, ref_grads))
    with torch.no_grad():
        assert torch.equal(ffn(x), y) and taken == [1, 1]
    ffn.eval()
    assert torch.equal(ffn(x), ffn.down(F.gelu(ffn.up(x))))
    ffn.train()
    _ffn("gelu_tanh")(x)
    _ffn("relu")(x)
    ffn.up.weight.ds_id = 0
    ffn(x)
    assert taken == [1, 1]
