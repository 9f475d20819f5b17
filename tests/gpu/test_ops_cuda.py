"""The fused CUDA kernels against a float64 reference (skipped without a GPU or without the extension).

Legend: N rows, M columns, D embedding size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.ops import SIN_FLOOR, cuda_available, info_nce_rows, library, nt_xent_rows

pytestmark = pytest.mark.gpu

REL_TOL = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module", autouse=True)
def _needs_extension():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not cuda_available():
        pytest.skip("CUDA extension not built (pip install --no-build-isolation -e . or ops.extension.build_jit())")


def reference_rows(q_ND, k_MD, pos_N, temperature, margin=0.0, self_N=None):
    """float64 (loss_N, lse_N) from full logits; margin gradient per the documented definition."""
    rows = torch.arange(q_ND.shape[0], device=q_ND.device)
    s_NM = q_ND.double() @ k_MD.double().t()
    c_N = s_NM[rows, pos_N]
    if margin:
        cc = c_N.detach().clamp(-1, 1)
        slope = math.cos(margin) + cc * math.sin(margin) / torch.sqrt(1 - cc * cc).clamp_min(SIN_FLOOR)
        c_N = torch.cos(torch.acos(cc) + margin) + (c_N - c_N.detach()) * slope
    s_pos_N = c_N / temperature
    s_NM = (s_NM / temperature).index_put((rows, pos_N), s_pos_N)
    if self_N is not None:
        s_NM = s_NM.index_put((rows, self_N), s_NM.new_tensor(float("-inf")))
    lse_N = torch.logsumexp(s_NM, dim=1)
    return lse_N - s_pos_N, lse_N


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _run(fn, q, k, w, v):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    loss, lse = fn(q, k)
    ((loss.double() * w).sum() + (lse.double() * v).sum()).backward()
    return loss, lse, q.grad, k.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("margin", [0.0, math.radians(10.0)])
@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 70, 40), (63, 64, 32), (65, 129, 100), (300, 1000, 256)])
@pytest.mark.parametrize("with_self", [False, True])
def test_cuda_matches_float64(dtype, margin, shape, with_self):
    n, m, d = shape
    if with_self and m < 2:
        pytest.skip("self exclusion needs two columns")
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + m)
    q = F.normalize(torch.randn(n, d, device="cuda", generator=gen), dim=1).to(dtype)
    k = F.normalize(torch.randn(m, d, device="cuda", generator=gen), dim=1).to(dtype)
    pos = torch.randint(0, m, (n,), device="cuda", generator=gen)
    self_idx = (pos + 1) % m if with_self else None
    w = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)
    v = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)
    got = _run(lambda a, b: info_nce_rows(a, b, pos, temperature=0.05, margin=margin, self_idx_N=self_idx,
                                          impl="cuda", return_lse=True), q, k, w, v)
    ref = _run(lambda a, b: reference_rows(a, b, pos, 0.05, margin, self_idx), q.double(), k.double(), w, v)
    for name, a, b in zip(("loss", "lse", "dq", "dk"), got, ref):
        assert _rel_err(a, b) < REL_TOL[dtype], (name, _rel_err(a, b))


# Large problems and the split-B path (few owned rows, many streamed ones: the binding splits the streamed
# operand over gridDim.y), against the float64 chunked path (the same function, computed in float64).
LARGE_SHAPES = [
    (4096, 4096, 768),
    (16384, 16384, 1024),
    (65536, 65536, 64),
    (65536, 65536, 1024),
    (64, 30000, 128),     # one row block: 16 splits of the columns
    (300, 65536, 1024),   # 5 row blocks: split-B with d = 1024
    (30000, 64, 256),     # many rows, one column tile (bwd_k runs split over the rows)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("margin", [0.0, math.radians(10.0)])
@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_large_and_split_match_float64(dtype, margin, shape):
    n, m, d = shape
    gen = torch.Generator(device="cuda").manual_seed(n + 3 * m + d)
    q = F.normalize(torch.randn(n, d, device="cuda", generator=gen), dim=1).to(dtype)
    k = F.normalize(torch.randn(m, d, device="cuda", generator=gen), dim=1).to(dtype)
    pos = torch.randint(0, m, (n,), device="cuda", generator=gen)
    self_idx = (pos + 1) % m
    w = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)
    v = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)

    def rows(impl, chunk):
        return lambda a, b: info_nce_rows(a, b, pos, temperature=0.05, margin=margin, self_idx_N=self_idx,
                                          impl=impl, chunk_size=chunk, return_lse=True)

    got = _run(rows("cuda", 1024), q, k, w, v)
    ref = _run(rows("torch", 4096), q.double(), k.double(), w, v)
    for name, a, b in zip(("loss", "lse", "dq", "dk"), got, ref):
        assert torch.isfinite(a).all(), name
        assert _rel_err(a, b) < REL_TOL[dtype], (name, _rel_err(a, b))


def test_float64_chunked_reference_matches_full_matrix():
    """The chunked float64 path used as the large-N reference equals the full-matrix float64 reference."""
    n, m, d = 700, 2500, 96
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = F.normalize(torch.randn(n, d, device="cuda", generator=gen, dtype=torch.float64), dim=1)
    k = F.normalize(torch.randn(m, d, device="cuda", generator=gen, dtype=torch.float64), dim=1)
    pos = torch.randint(0, m, (n,), device="cuda", generator=gen)
    self_idx = (pos + 1) % m
    w = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)
    v = torch.rand(n, device="cuda", dtype=torch.float64, generator=gen)
    margin = math.radians(10.0)
    got = _run(lambda a, b: info_nce_rows(a, b, pos, temperature=0.05, margin=margin, self_idx_N=self_idx,
                                          impl="torch", chunk_size=512, return_lse=True), q, k, w, v)
    ref = _run(lambda a, b: reference_rows(a, b, pos, 0.05, margin, self_idx), q, k, w, v)
    for name, a, b in zip(("loss", "lse", "dq", "dk"), got, ref):
        assert _rel_err(a, b) < 1e-10, (name, _rel_err(a, b))


def test_cuda_nt_xent_matches_torch_path():
    gen = torch.Generator(device="cuda").manual_seed(0)
    z_a = torch.randn(200, 128, device="cuda", generator=gen, requires_grad=True)
    z_b = torch.randn(200, 128, device="cuda", generator=gen, requires_grad=True)
    out = {}
    for impl in ("cuda", "torch"):
        loss = nt_xent_rows(z_a, z_b, temperature=0.1, impl=impl)
        ga, gb = torch.autograd.grad(loss.sum(), (z_a, z_b))
        out[impl] = (loss, ga, gb)
    for a, b in zip(out["cuda"], out["torch"]):
        assert _rel_err(a, b) < 5e-5


def test_opcheck_and_compile_on_cuda():
    q = F.normalize(torch.randn(70, 64, device="cuda"), dim=1).requires_grad_()
    k = F.normalize(torch.randn(90, 64, device="cuda"), dim=1).requires_grad_()
    excl = torch.stack([torch.arange(70, device="cuda"), torch.full((70,), -1, device="cuda")], dim=1)
    torch.library.opcheck(torch.ops.pretrain_ops.masked_lse.default, (q, k, excl, 20.0, 32))
    f = torch.compile(lambda a, b: library.masked_lse(a, b, excl, 20.0, 32).sum(), fullgraph=True)
    val = f(q, k)
    ref = library.masked_lse(q, k, excl, 20.0, 32).sum()
    torch.testing.assert_close(val, ref)


def test_memory_is_linear_in_n():
    n, d = 16384, 256
    q = F.normalize(torch.randn(n, d, device="cuda"), dim=1).bfloat16().requires_grad_()
    k = F.normalize(torch.randn(n, d, device="cuda"), dim=1).bfloat16().requires_grad_()
    pos = torch.arange(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    info_nce_rows(q, k, pos, temperature=0.05, impl="cuda").sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 64 * n * d  # a few O(N*d) fp32 buffers; the N x N logits alone would be 1 GiB


def test_fp16_mean_reduced_gradient_does_not_underflow():
    n, d = 4096, 64
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = F.normalize(torch.randn(n, d, device="cuda", generator=gen), dim=1).half()
    k = F.normalize(torch.randn(n, d, device="cuda", generator=gen), dim=1).half()
    pos = torch.arange(n, device="cuda")
    grads = {}
    for name, a, b, impl in (("cuda", q, k, "cuda"), ("ref", q.double(), k.double(), "torch")):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        info_nce_rows(a, b, pos, temperature=0.05, impl=impl).mean().backward()
        grads[name] = (a.grad, b.grad)
    for got, ref in zip(grads["cuda"], grads["ref"]):
        assert _rel_err(got, ref) < 5e-3
