"""CLEAR's NT-Xent (SimCLR) loss over the 2N augmented views of a batch.

Rows are cat(z_a, z_b); row i's positive is its partner view, the other 2N-2 views (of every
rank, gathered with gradient) are negatives. Legend: N = local batch, P = projection size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain import ops


def nt_xent(z_a_NP: torch.Tensor, z_b_NP: torch.Tensor, *, temperature: float, impl: str = "auto",
            chunk_size: int = 1024, gather=None):
    """-> (loss_sum over the 2N local rows, 2N, metrics {"cl_acc": (correct, 2N)}).

    ``gather``: the caller's ``rows -> (keys, offset)`` when the negatives are more than this rank's views
    (see ``ops.nt_xent_rows``)."""
    loss_2N = ops.nt_xent_rows(z_a_NP, z_b_NP, temperature=temperature, impl=impl, chunk_size=chunk_size,
                               gather=gather)
    count = loss_2N.numel()
    with torch.no_grad():
        correct = _local_top1(z_a_NP, z_b_NP, chunk_size)
    return loss_2N.sum(), count, {"cl_acc": (correct, count)}


@torch.no_grad()
def _local_top1(z_a_NP, z_b_NP, chunk_size: int) -> torch.Tensor:
    """Rows whose partner is the most similar view within this rank's 2N views (chunked, O(N*chunk))."""
    z = F.normalize(torch.cat([z_a_NP, z_b_NP]).float(), dim=-1)
    n2 = z.shape[0]
    half = n2 // 2
    partner = (torch.arange(n2, device=z.device) + half) % n2
    correct = z.new_zeros((), dtype=torch.int64)  # stays on the device: no host sync mid-forward
    for start in range(0, n2, chunk_size):
        rows = z[start:start + chunk_size]
        sim = rows @ z.T
        sim.diagonal(offset=start).fill_(float("-inf"))  # each row's own view (no index_put: no sync)
        correct += (sim.argmax(dim=1) == partner[start:start + rows.shape[0]]).sum()
    return correct
