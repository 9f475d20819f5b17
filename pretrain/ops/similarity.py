"""In-batch softmax losses over similarity matrices: InfoNCE / ArcCon rows and NT-Xent.

Every row loss is  loss_i = lse_i - s_i,pos  with  s_ij = q_i.k_j / T  (the positive's logit is
cos(acos(c) + margin) / T, ArcCon) and lse_i over all columns but the excluded self column. It is
split as  lse_i = logaddexp(lse'_i, s_i,pos)  where lse'_i (positive and self excluded) comes from a
backend that never materialises N x M: the fused CUDA kernel, or the chunked torch path. The
positive's logit is an O(N*d) gather, so the margin never enters the kernels.
Legend: N rows, M columns, D embedding size, E = 2 exclusions per row (positive, self).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from pretrain.ops import chunked, extension, library
from pretrain.ops.chunked import acc_dtype
from pretrain.ops.margin import arc_margin

Impl = Literal["auto", "cuda", "torch", "eager"]
IMPLS = ("auto", "cuda", "torch", "eager")


def resolve_impl(impl: str, device: torch.device) -> str:
    """The concrete backend ('cuda', 'torch' or 'eager') for `impl` on tensors of `device`."""
    if impl not in IMPLS:
        raise ValueError(f"similarity impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if device.type == "cuda" and extension.cuda_available() and kernel_self_check(device):
            return "cuda"
        return "torch"
    if impl == "cuda":
        if device.type != "cuda":
            raise ValueError(f"impl='cuda' needs CUDA tensors, got {device}; use impl='auto' or 'torch'")
        if not extension.cuda_available():
            raise ValueError(
                "impl='cuda' but the CUDA extension is not built: reinstall with "
                "`pip install --no-build-isolation -e .` on a CUDA machine, or call "
                "pretrain.ops.extension.build_jit(), or use impl='torch'"
            )
    return impl


_SELF_CHECK: dict[str, bool] = {}
SELF_CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def kernel_self_check(device) -> bool:
    """Whether the fused kernel computes what the torch path computes on ``device`` (once per device).

    ``ops.similarity: auto`` uses the kernel only after this: a small random problem (96 x 130 x 64, fp32
    and bf16, a self exclusion and an ArcCon margin) through both paths, loss and both gradients compared.
    A mismatch (or an error) warns once and ``auto`` falls back to the torch path on that device."""
    key = str(device)
    if key not in _SELF_CHECK:
        try:
            errors = _self_check_errors(device)
            bad = {k: v for k, v in errors.items() if not v <= SELF_CHECK_TOL[k[0]]}
            reason = ", ".join(f"{dt} {name} rel. err {err:.2e}" for (dt, name), err in bad.items())
        except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not trust it
            bad, reason = {"error": True}, f"{type(e).__name__}: {e}"
        _SELF_CHECK[key] = not bad
        if bad:
            warnings.warn(f"ops.similarity=auto: the CUDA kernel disagrees with the torch path on {device} "
                          f"({reason}); using the torch path there. Rebuild the extension, or set "
                          f"ops.similarity=torch (or =cuda to force the kernel).", RuntimeWarning, stacklevel=3)
    return _SELF_CHECK[key]


def _self_check_errors(device) -> dict:
    gen = torch.Generator().manual_seed(20261122)
    q = F.normalize(torch.randn(96, 64, generator=gen), dim=1).to(device)
    k = F.normalize(torch.randn(130, 64, generator=gen), dim=1).to(device)
    pos = torch.randint(0, 130, (96,), generator=gen).to(device)
    self_idx = (pos + 1) % 130
    errors = {}
    for dtype in SELF_CHECK_TOL:
        outs = {}
        for backend in ("cuda", "torch"):
            a = q.to(dtype).clone().requires_grad_()
            b = k.to(dtype).clone().requires_grad_()
            loss, _ = _rows(a, b, pos, self_idx, 20.0, math.radians(10.0), backend, 32)
            ga, gb = torch.autograd.grad(loss.sum(), (a, b))
            outs[backend] = (loss, ga, gb)
        for name, x, y in zip(("loss", "dq", "dk"), outs["cuda"], outs["torch"]):
            x, y = x.detach().double(), y.detach().double()
            errors[(dtype, name)] = float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
    return errors


def _check_inputs(q_ND, k_MD, pos_idx_N, self_idx_N, temperature, chunk_size, check_values: bool = True) -> None:
    if q_ND.dim() != 2 or k_MD.dim() != 2 or q_ND.shape[1] != k_MD.shape[1]:
        raise ValueError(f"q and k must be (N, D) and (M, D), got {tuple(q_ND.shape)} and {tuple(k_MD.shape)}")
    if q_ND.dtype != k_MD.dtype or q_ND.device != k_MD.device:
        raise ValueError(f"q and k must share dtype and device, got {q_ND.dtype}/{k_MD.dtype}")
    if q_ND.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"q and k must be floating point, got {q_ND.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_rows, num_cols = q_ND.shape[0], k_MD.shape[0]
    for name, idx in (("pos_idx", pos_idx_N), ("self_idx", self_idx_N)):
        if idx is None:
            continue
        if idx.shape != (num_rows,) or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"{name} must be an integer tensor of shape ({num_rows},), got {idx.dtype} {tuple(idx.shape)}"
            )
        if torch.compiler.is_compiling() or num_rows == 0 or not check_values:
            continue  # data-dependent checks would break the graph (and cost a host sync each)
        if int(idx.min()) < 0 or int(idx.max()) >= num_cols:
            raise ValueError(f"{name} values must lie in [0, {num_cols}) (the columns of k)")
    if self_idx_N is not None and check_values and not torch.compiler.is_compiling():
        if bool((self_idx_N.to(pos_idx_N.device) == pos_idx_N).any()):
            raise ValueError("self_idx equals pos_idx for some row: the positive cannot be the excluded column")


def _masked_lse(q_ND, k_MD, excl_NE, inv_temp: float, impl: str, chunk_size: int) -> torch.Tensor:
    if impl == "cuda":
        return library.masked_lse(q_ND.contiguous(), k_MD.contiguous(), excl_NE, inv_temp, chunk_size)
    if k_MD is q_ND:  # NT-Xent's keys are its rows: torch.compile cannot trace one tensor as two inputs
        k_MD = k_MD.view_as(k_MD)
    return chunked.ChunkedMaskedLSE.apply(q_ND, k_MD, excl_NE, inv_temp, chunk_size)


def _eager_lse(q_ND, k_MD, pos_idx_N, self_idx_N, s_pos_N, inv_temp: float) -> torch.Tensor:
    """Materialises the N x M logits (fp32): the baseline the fused paths are measured against."""
    acc = acc_dtype(q_ND.dtype)
    s_NM = (q_ND.to(acc) @ k_MD.to(acc).t()) * inv_temp
    rows_N = torch.arange(q_ND.shape[0], device=q_ND.device)
    s_NM = s_NM.index_put((rows_N, pos_idx_N.long()), s_pos_N)
    if self_idx_N is not None:
        s_NM = s_NM.index_put((rows_N, self_idx_N.long()), s_NM.new_tensor(float("-inf")))
    return torch.logsumexp(s_NM, dim=1)


def info_nce_rows(
    q_ND: torch.Tensor,
    k_MD: torch.Tensor,
    pos_idx_N: torch.Tensor,
    *,
    temperature: float,
    margin: float = 0.0,
    self_idx_N: torch.Tensor | None = None,
    impl: str = "auto",
    chunk_size: int = 1024,
    return_lse: bool = False,
    check_values: bool = True,
):
    """Per-row InfoNCE/ArcCon loss_N (fp32, not reduced) of L2-normalised q against k; (loss_N, lse_N) if return_lse.

    Row i's positive is column pos_idx[i] (logit cos(acos(c) + margin)/T, margin in radians);
    column self_idx[i] is left out of the softmax. Differentiable w.r.t. q and k. ``check_values``: the indices'
    range is checked (a host read of them: a sync on a GPU); off for indices the caller built itself (the
    trainer's terms), so that its step syncs nothing.
    """
    _check_inputs(q_ND, k_MD, pos_idx_N, self_idx_N, temperature, chunk_size, check_values)
    backend = resolve_impl(impl, q_ND.device)
    pos_idx_N = pos_idx_N.to(q_ND.device, torch.long)
    if self_idx_N is not None:
        self_idx_N = self_idx_N.to(q_ND.device, torch.long)
    loss_N, lse_N = _rows(q_ND, k_MD, pos_idx_N, self_idx_N, 1.0 / float(temperature), margin, backend, chunk_size)
    return (loss_N, lse_N) if return_lse else loss_N


def _rows(q_ND, k_MD, pos_idx_N, self_idx_N, inv_temp: float, margin: float, backend: str, chunk_size: int):
    """(loss_N, lse_N) on checked inputs through one concrete backend ('cuda', 'torch' or 'eager')."""
    acc = acc_dtype(q_ND.dtype)
    c_pos_N = (q_ND.to(acc) * k_MD[pos_idx_N].to(acc)).sum(dim=1)
    s_pos_N = (arc_margin(c_pos_N, margin) if margin != 0.0 else c_pos_N) * inv_temp
    if backend == "eager":
        lse_N = _eager_lse(q_ND, k_MD, pos_idx_N, self_idx_N, s_pos_N, inv_temp)
    else:
        none_N = torch.full_like(pos_idx_N, -1)
        excl_NE = torch.stack([pos_idx_N, none_N if self_idx_N is None else self_idx_N], dim=1)
        lse_rest_N = _masked_lse(q_ND, k_MD, excl_NE, inv_temp, backend, chunk_size)
        lse_N = torch.logaddexp(lse_rest_N, s_pos_N)
    return lse_N - s_pos_N, lse_N


def nt_xent_rows(
    z_a_ND: torch.Tensor,
    z_b_ND: torch.Tensor,
    *,
    temperature: float,
    impl: str = "auto",
    chunk_size: int = 1024,
    gather=None,
) -> torch.Tensor:
    """CLEAR/SimCLR NT-Xent loss_2N (fp32) over rows cat(z_a, z_b): positive = partner view, self excluded.

    The rows are cat(z_a, z_b) L2-normalised (in fp32 for half inputs); the columns are those rows, or
    ``gather(rows) -> (keys_CD, offset)`` when the caller supplies it (e.g. every rank's rows, gathered with
    gradient, this rank's block at ``offset``): ops never communicate themselves. Only this rank's 2N rows
    are computed. Inputs need not be normalised.
    """
    if z_a_ND.shape != z_b_ND.shape or z_a_ND.dim() != 2:
        raise ValueError(f"z_a and z_b must both be (N, D), got {tuple(z_a_ND.shape)} and {tuple(z_b_ND.shape)}")
    num_pairs = z_a_ND.shape[0]
    z_RD = F.normalize(torch.cat([z_a_ND, z_b_ND]).to(acc_dtype(z_a_ND.dtype)), dim=1).to(z_a_ND.dtype)
    cols_CD, offset = (z_RD, 0) if gather is None else gather(z_RD)
    if cols_CD.shape[1] != z_RD.shape[1] or not 0 <= offset <= cols_CD.shape[0] - z_RD.shape[0]:
        raise ValueError(f"gathered keys {tuple(cols_CD.shape)} at offset {offset} do not hold this rank's "
                         f"{tuple(z_RD.shape)} rows")
    # The indices are built here, so only the structural checks run (a value check is a host sync each).
    rows_R = torch.arange(2 * num_pairs, device=z_RD.device)
    pos_idx_R = (rows_R + num_pairs) % (2 * num_pairs) + offset
    _check_inputs(z_RD, cols_CD, pos_idx_R, None, temperature, chunk_size, check_values=False)
    backend = resolve_impl(impl, z_RD.device)
    return _rows(z_RD, cols_CD, pos_idx_R, rows_R + offset, 1.0 / float(temperature), 0.0, backend, chunk_size)[0]
