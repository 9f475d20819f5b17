"""pretrain.ops on CPU: chunked torch path and eager path against a float64 full-matrix reference.

Legend: N rows, M columns, D embedding size.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from pretrain.ops import (
    SIN_FLOOR,
    arc_margin,
    cuda_available,
    info_nce_rows,
    library,
    nt_xent_rows,
    resolve_impl,
)

DEG10 = math.radians(10.0)
# max |a - b| / max |b| allowed per input dtype (outputs of half inputs are rounded to that dtype)
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def reference_rows(q_ND, k_MD, pos_N, temperature, margin=0.0, self_N=None):
    """float64 (loss_N, lse_N) from the full N x M logits; the margin gradient follows the documented
    definition cos m + c sin m / max(sin theta, SIN_FLOOR), written independently of pretrain.ops."""
    rows = torch.arange(q_ND.shape[0])
    s_NM = q_ND.double() @ k_MD.double().t()
    c_N = s_NM[rows, pos_N]
    if margin:
        cc = c_N.detach().clamp(-1, 1)
        value = torch.cos(torch.acos(cc) + margin)
        slope = math.cos(margin) + cc * math.sin(margin) / torch.sqrt(1 - cc * cc).clamp_min(SIN_FLOOR)
        c_N = value + (c_N - c_N.detach()) * slope
    s_pos_N = c_N / temperature
    s_NM = (s_NM / temperature).index_put((rows, pos_N), s_pos_N)
    if self_N is not None:
        s_NM = s_NM.index_put((rows, self_N), torch.tensor(float("-inf"), dtype=torch.float64))
    lse_N = torch.logsumexp(s_NM, dim=1)
    return lse_N - s_pos_N, lse_N


def _unit(n, d, dtype, gen):
    return F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def _rel_err(a, b, scale=None):
    """max |a - b| / max |scale| (scale defaults to b). A loss lse - s_pos is compared on the scale of
    lse: the difference of two ~1/temperature terms can be ~1e-2, and its rounding error is set by the terms."""
    scale = b if scale is None else scale
    return ((a.double() - b.double()).abs().max() / scale.double().abs().max().clamp_min(1e-12)).item()


def _loss_and_grads(fn, q, k, w_N, v_N):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    loss_N, lse_N = fn(q, k)
    # Weighted sums so that every row's gradient scale is exercised, lse included (RankCSE uses it).
    ((loss_N.double() * w_N).sum() + (lse_N.double() * v_N).sum()).backward()
    return loss_N, lse_N, q.grad, k.grad


CASES = [
    # (N, M, D, chunk, with_self)
    (37, 53, 24, 16, False),
    (50, 50, 32, 7, True),
    (1, 9, 8, 4, False),
]


@pytest.mark.parametrize("impl", ["torch", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("margin", [0.0, DEG10])
@pytest.mark.parametrize("case", CASES)
def test_info_nce_rows_matches_float64(impl, dtype, margin, case):
    num_rows, num_cols, dim, chunk, with_self = case
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so hash() drew new inputs in every process.
    gen = torch.Generator().manual_seed(zlib.crc32(repr((num_rows, num_cols, dim, str(dtype), margin)).encode()))
    q, k = _unit(num_rows, dim, dtype, gen), _unit(num_cols, dim, dtype, gen)
    pos = torch.randint(0, num_cols, (num_rows,), generator=gen)
    self_idx = (pos + 1 + torch.randint(0, num_cols - 1, (num_rows,), generator=gen)) % num_cols if with_self else None
    w, v = torch.rand(num_rows, generator=gen, dtype=torch.float64), torch.rand(num_rows, generator=gen, dtype=torch.float64)
    got = _loss_and_grads(
        lambda a, b: info_nce_rows(a, b, pos, temperature=0.07, margin=margin, self_idx_N=self_idx,
                                   impl=impl, chunk_size=chunk, return_lse=True), q, k, w, v)
    ref = _loss_and_grads(lambda a, b: reference_rows(a, b, pos, 0.07, margin, self_idx), q.double(), k.double(), w, v)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    scales = (ref[1], ref[1], ref[2], ref[3])
    for name, a, b, scale in zip(("loss", "lse", "dq", "dk"), got, ref, scales):
        assert _rel_err(a, b, scale) < REL_TOL[dtype], (name, _rel_err(a, b, scale))


def test_single_row_single_column_has_zero_loss_and_gradient():
    q, k = _unit(1, 8, torch.float32, torch.Generator().manual_seed(0)), _unit(1, 8, torch.float32, torch.Generator().manual_seed(1))
    q.requires_grad_()
    loss = info_nce_rows(q, k, torch.zeros(1, dtype=torch.long), temperature=0.1, impl="torch")
    loss.sum().backward()
    assert loss.item() == 0.0 and torch.all(q.grad == 0)


@pytest.mark.parametrize("margin", [0.0, DEG10])
def test_duplicate_rows_positive_at_cos_one(margin):
    gen = torch.Generator().manual_seed(3)
    base = _unit(5, 16, torch.float32, gen)
    q = torch.cat([base, base[:3]])  # duplicated rows
    k = q.clone()  # positive of row i is an identical vector: theta = 0
    pos = torch.arange(8)
    w, v = torch.rand(8, generator=gen, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    got = _loss_and_grads(lambda a, b: info_nce_rows(a, b, pos, temperature=0.5, margin=margin,
                                                       impl="torch", chunk_size=3, return_lse=True), q, k, w, v)
    ref = _loss_and_grads(lambda a, b: reference_rows(a, b, pos, 0.5, margin), q.double(), k.double(), w, v)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert _rel_err(a, b) < 1e-4


def test_arc_margin_value_and_gradient_near_zero_and_pi():
    margin = DEG10
    c = torch.tensor([-1.0, -1.0 + 1e-9, -0.99999, -0.9, 0.0, 0.5, 0.99, 0.99999, 1.0 - 1e-9, 1.0, 1.0 + 1e-6],
                     dtype=torch.float64, requires_grad=True)
    out = arc_margin(c, margin)
    out.sum().backward()
    cc = c.detach().clamp(-1, 1)
    torch.testing.assert_close(out.detach(), torch.cos(torch.acos(cc) + margin))
    assert torch.isfinite(c.grad).all()
    assert c.grad.abs().max() <= math.cos(margin) + math.sin(margin) / SIN_FLOOR + 1e-9
    # Where sin(theta) >= SIN_FLOOR the gradient is the exact derivative of cos(acos(c) + m).
    interior = torch.linspace(-0.99, 0.99, 41, dtype=torch.float64, requires_grad=True)
    exact = torch.autograd.grad(torch.cos(torch.acos(interior) + margin).sum(), interior)[0]
    mine = torch.autograd.grad(arc_margin(interior, margin).sum(), interior)[0]
    torch.testing.assert_close(mine, exact)
    # Continuous across the floor: no jump where sin(theta) crosses SIN_FLOOR.
    c_floor = math.sqrt(1 - SIN_FLOOR**2)
    around = torch.tensor([c_floor - 1e-12, c_floor + 1e-12], dtype=torch.float64, requires_grad=True)
    g = torch.autograd.grad(arc_margin(around, margin).sum(), around)[0]
    assert abs(g[0] - g[1]) < 1e-5


def reference_nt_xent(z_a, z_b, temperature):
    z = F.normalize(torch.cat([z_a, z_b]).double(), dim=1)
    n = z_a.shape[0]
    sim = z @ z.t() / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    labels = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, labels, reduction="none")


@pytest.mark.parametrize("num_pairs", [1, 13])
@pytest.mark.parametrize("impl", ["torch", "eager"])
def test_nt_xent_rows_matches_cross_entropy(num_pairs, impl):
    gen = torch.Generator().manual_seed(num_pairs)
    z_a = torch.randn(num_pairs, 20, generator=gen, requires_grad=True)
    z_b = torch.randn(num_pairs, 20, generator=gen, requires_grad=True)
    got = nt_xent_rows(z_a, z_b, temperature=0.1, impl=impl, chunk_size=5)
    got.sum().backward()
    ga, gb = z_a.grad, z_b.grad
    za64, zb64 = z_a.detach().double().requires_grad_(), z_b.detach().double().requires_grad_()
    ref = reference_nt_xent(za64, zb64, 0.1)
    ref.sum().backward()
    assert got.shape == (2 * num_pairs,)
    assert _rel_err(got, ref) < 1e-5
    assert _rel_err(ga, za64.grad) < 1e-4 and _rel_err(gb, zb64.grad) < 1e-4


def test_chunked_path_never_allocates_the_full_matrix():
    n = 512
    gen = torch.Generator().manual_seed(0)
    q, k = _unit(n, 32, torch.float32, gen).requires_grad_(), _unit(n, 32, torch.float32, gen).requires_grad_()
    pos = torch.arange(n)

    def largest_allocation(impl):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            info_nce_rows(q, k, pos, temperature=0.1, impl=impl, chunk_size=32).sum().backward()
        return max(e.cpu_memory_usage for e in prof.events())

    full = n * n * 4
    assert largest_allocation("eager") >= full  # the probe sees N x M buffers when they exist
    assert largest_allocation("torch") <= full // 8


def test_dispatch_and_validation():
    q = _unit(4, 8, torch.float32, torch.Generator().manual_seed(0))
    pos = torch.arange(4)
    assert not cuda_available()
    assert resolve_impl("auto", q.device) == "torch"
    with pytest.raises(ValueError, match="impl"):
        info_nce_rows(q, q, pos, temperature=0.1, impl="triton")
    with pytest.raises(ValueError, match="CUDA tensors"):
        info_nce_rows(q, q, pos, temperature=0.1, impl="cuda")
    with pytest.raises(ValueError, match="pos_idx"):
        info_nce_rows(q, q, pos + 1, temperature=0.1)
    with pytest.raises(ValueError, match="self_idx equals pos_idx"):
        info_nce_rows(q, q, pos, temperature=0.1, self_idx_N=pos)
    with pytest.raises(ValueError, match="temperature"):
        info_nce_rows(q, q, pos, temperature=0.0)
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        info_nce_rows(q, q[:, :4], pos, temperature=0.1)


def _op_args(n=6, m=11, d=8, requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    q = _unit(n, d, torch.float32, gen).requires_grad_(requires_grad)
    k = _unit(m, d, torch.float32, gen).requires_grad_(requires_grad)
    excl = torch.stack([torch.arange(n) % m, (torch.arange(n) + 3) % m], dim=1)
    return q, k, excl


def test_opcheck_custom_ops():
    q, k, excl = _op_args()
    torch.library.opcheck(torch.ops.pretrain_ops.masked_lse.default, (q, k, excl, 10.0, 4))
    lse = library.masked_lse(q.detach(), k.detach(), excl, 10.0, 4)
    grad = torch.rand(6)
    torch.library.opcheck(torch.ops.pretrain_ops.masked_lse_backward.default,
                          (q.detach(), k.detach(), excl, 10.0, lse, grad, 4))


def test_custom_op_under_torch_compile():
    q, k, excl = _op_args()

    def f(a, b):
        return (library.masked_lse(a, b, excl, 10.0, 4) * torch.arange(1.0, 7.0)).sum()

    eager_val = f(q, k)
    eager_grads = torch.autograd.grad(eager_val, (q, k))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    val = compiled(q, k)
    grads = torch.autograd.grad(val, (q, k))
    torch.testing.assert_close(val, eager_val)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_jit_build_explains_a_cpu_only_torch():
    from pretrain.ops import extension

    if torch.version.cuda is not None:
        pytest.skip("CUDA torch: the JIT build is exercised by tests/gpu")
    assert all((extension.CSRC_DIR / name).is_file() for name in extension.SOURCES)
    with pytest.raises(ValueError, match="CUDA build of torch"):
        extension.build_jit()


# ----------------------------------------------------------------------------- kernel self-check (auto)

def test_auto_trusts_the_kernel_only_after_its_self_check(monkeypatch):
    """On CPU, with stand-ins: a kernel that agrees with the torch path is used by `auto`, one that does not
    is refused with a warning (once per device) and `auto` falls back to the torch path."""
    from pretrain.ops import extension, library
    from pretrain.ops import similarity as sim

    monkeypatch.setattr(extension, "cuda_available", lambda: True)

    # The CUDA op on CPU tensors runs the chunked implementation: it agrees.
    monkeypatch.setattr(sim, "_SELF_CHECK", {})
    assert sim.kernel_self_check(torch.device("cpu")) is True
    monkeypatch.setattr(sim, "_SELF_CHECK", {"cuda:7": True})
    assert sim.resolve_impl("auto", torch.device("cuda", 7)) == "cuda"

    # A stand-in kernel that is off by 1e-2 in its log-sum-exp is caught and refused.
    real = library.masked_lse
    monkeypatch.setattr(library, "masked_lse", lambda q, k, excl, t, c: real(q, k, excl, t, c) + 1e-2)
    monkeypatch.setattr(sim, "_SELF_CHECK", {})
    with pytest.warns(RuntimeWarning, match="disagrees with the torch path on cpu .*float32 loss rel. err"):
        assert sim.kernel_self_check(torch.device("cpu")) is False
    assert sim.kernel_self_check(torch.device("cpu")) is False  # decided once per device, warned once
    monkeypatch.setattr(sim, "_SELF_CHECK", {"cuda:7": False})
    assert sim.resolve_impl("auto", torch.device("cuda", 7)) == "torch"
