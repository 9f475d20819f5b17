"""Two gloo ranks on CPU: gathered-with-gradient NT-Xent equals the single-process loss and gradients.

Legend: n pairs per rank, W = 2 ranks, D embedding size.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.distributed.comm import all_gather_with_grad, all_reduce_sum
from pretrain.distributed.env import DistEnv
from pretrain.ops import nt_xent_rows

WORLD = 2
PAIRS, DIM, TEMP = 5, 12, 0.1
IMPLS = ("torch", "eager")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_batch():
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(WORLD * PAIRS, DIM, generator=gen), torch.randn(WORLD * PAIRS, DIM, generator=gen)


def _env(rank: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, node_rank=0,
                   master_addr="127.0.0.1", master_port=0, launcher="torchrun")


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        env = _env(rank)
        z_a_all, z_b_all = _global_batch()
        block = slice(rank * PAIRS, (rank + 1) * PAIRS)
        result = {}
        for impl in IMPLS:
            z_a = z_a_all[block].clone().requires_grad_()
            z_b = z_b_all[block].clone().requires_grad_()
            loss = nt_xent_rows(z_a, z_b, temperature=TEMP, impl=impl, chunk_size=3,  # the caller gathers
                                gather=lambda rows: (all_gather_with_grad(rows, env), rank * rows.shape[0]))
            loss.sum().backward()
            result[impl] = {"loss": loss.detach(), "ga": z_a.grad, "gb": z_b.grad}

        # The gather alone: per-rank weights on the gathered block; x's gradient sums all ranks' weights.
        x = torch.full((3, 2), float(rank + 1), requires_grad=True)
        weight = torch.arange(12.0).reshape(6, 2) * (rank + 1)
        gathered = all_gather_with_grad(x, env)
        (gathered * weight).sum().backward()
        total = all_reduce_sum(torch.tensor([float(rank + 1)]), env)
        result.update(gathered=gathered.detach(), x_grad=x.grad, total=total)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gathered_nt_xent_matches_single_process(tmp_path):
    # One spawn for both implementations: process start-up dominates this test's time.
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    z_a_all, z_b_all = _global_batch()
    z_a_all.requires_grad_()
    z_b_all.requires_grad_()
    ref = nt_xent_rows(z_a_all.double(), z_b_all.double(), temperature=TEMP, impl="eager")
    ref.sum().backward()
    total_pairs = WORLD * PAIRS
    for rank, res in enumerate(results):
        block = slice(rank * PAIRS, (rank + 1) * PAIRS)
        # Local rows are [a-views, b-views] of this rank; the reference rows are [all a, all b].
        ref_local = torch.cat([ref[block], ref[total_pairs:][block]]).float()
        for impl in IMPLS:
            got = res[impl]
            torch.testing.assert_close(got["loss"], ref_local, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["ga"], z_a_all.grad[block].float(), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(got["gb"], z_b_all.grad[block].float(), rtol=1e-4, atol=1e-6)

        assert torch.equal(res["gathered"], torch.cat([torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)]))
        weights = sum(torch.arange(12.0).reshape(6, 2) * (r + 1) for r in range(WORLD))
        torch.testing.assert_close(res["x_grad"], weights[rank * 3 : (rank + 1) * 3])
        assert res["total"].item() == 3.0


def test_single_process_env_is_a_no_op():
    x = torch.randn(4, 3, requires_grad=True)
    single = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                     master_addr="127.0.0.1", master_port=0)
    assert all_gather_with_grad(x, single) is x
    assert all_reduce_sum(x, single) is x
