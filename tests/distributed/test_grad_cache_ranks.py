"""objective.gradient_cache through DeepSpeed on 1 and 2 gloo ranks, ZeRO 0, 2 and 3: one optimizer step
(``training/cached_step.py: cached_optimizer_step``) updates the weights as the whole step's gradient says.

The step's rows are split over the ranks and, on each rank, into chunks (micro-batches) of sizes that divide the
rank's rows and sizes that do not. The float64 reference holds every rank's every chunk's graph in one process
(tests/grad_cache_reference.py), each chunk under its (rank, chunk) RNG key, dropout on. With AdamW's first step at
eps = 1 >> |g|, no weight decay and no clipping, the update is -lr * g / (|g| + 1): the gradient, checked through the
weights DeepSpeed actually changed (ZeRO 2-3 partition the gradients). With dropout off the cached step also equals
DeepSpeed's own uncached step on one micro-batch holding each rank's whole share (grad_accum 1), and the uncached
grad_accum = 2 step (negatives limited to the micro-batch) does not.
"""

from __future__ import annotations

import gc
import socket

import grad_cache_reference as R
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.config import DistributedConfig, OptimConfig, TrainConfig
from pretrain.distributed.env import DistEnv

ROWS = 10
"""Sentences per rank in the step."""

RUNS = {
    1: [("clear", (4, 4, 2), 0, "cached"), ("clear", (5, 5), 2, "cached"), ("simcse_arccse", (3, 3, 4), 2, "cached")],
    2: [("clear", (4, 4, 2), 0, "cached"), ("clear", (4, 4, 2), 2, "cached"), ("simcse_arccse", (5, 5), 2, "cached"),
        ("clear", (3, 7), 3, "cached"), ("simcse_sup", (4, 6), 2, "cached"),
        ("simcse_sup_matryoshka", (3, 7), 1, "cached"),
        ("clear", (5, 5), 2, "nodrop_cached"), ("clear", (10,), 2, "nodrop_full"), ("clear", (5, 5), 2, "nodrop_accum")],
}
"""world size -> (objective, chunk sizes, ZeRO stage, mode) per step run; a mode's ``nodrop_`` runs without dropout,
``full``/``accum`` through the uncached step."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.nn.functional.dropout = R.dtype_free_dropout  # this process's only: the float64 reference draws alike
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from pretrain.distributed.engine import Engine
        from pretrain.metrics.accumulate import MetricSums
        from pretrain.training.cached_step import cached_optimizer_step
        from pretrain.training.optim import build_param_groups, lr_lambda
        from pretrain.training.step import optimizer_step

        env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0,
                      master_addr="127.0.0.1", master_port=port, launcher="torchrun")
        results = []
        for case, sizes, zero_stage, mode in RUNS[world]:
            module = R.case_module(case, env=env, dropout=0.0 if mode.startswith("nodrop") else 0.1)
            optim = OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, warmup_steps=0, clip_grad_norm=0.0)
            engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                            train=TrainConfig(micro_batch_size=max(sizes), grad_accum=len(sizes)), env=env,
                            dist=DistributedConfig(zero_stage=zero_stage), lr_lambda=lr_lambda(optim, 10))
            batch = R.step_batch(R.CASES[case][0], world * ROWS)
            mine = {k: v[rank * ROWS:(rank + 1) * ROWS] for k, v in batch.items()}
            chunks = iter(R.split_chunks(mine, list(sizes)))
            step = optimizer_step if mode.endswith(("full", "accum")) else cached_optimizer_step
            sums = MetricSums()
            result = step(engine, chunks.__next__, sums, env=env, grad_accum=len(sizes), seed=R.SEED,
                          step=R.STEP, precision="fp32")
            results.append({"weights": R.gathered_weights(module), "lr": result.info.lr,
                            "skipped": result.info.skipped, "loss": sums.reduce(env)["loss"]})
            del engine, module
            gc.collect()
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _expected_update(case: str, world: int, sizes, *, dropout: float) -> tuple[dict, float]:
    """-lr * g / (|g| + 1) of the float64 whole-step gradient (lr 1), and the whole step's loss."""
    module = R.to_double(R.case_module(case, dropout=dropout))
    batch = R.step_batch(R.CASES[case][0], world * ROWS)
    chunks, keys = [], []
    for rank in range(world):
        mine = {k: v[rank * ROWS:(rank + 1) * ROWS] for k, v in batch.items()}
        chunks += [R.as_double(c) for c in R.split_chunks(mine, list(sizes))]
        keys += [(rank, k) for k in range(len(sizes))]
    grads, loss = R.reference_grads(module, chunks, keys)
    return {n: -g / (g.abs() + 1.0) for n, g in grads.items()}, loss


def _run(world: int, tmp_path) -> list[dict]:
    out = str(tmp_path / f"world{world}.pt")
    mp.start_processes(_worker, args=(world, _free_port(), out), nprocs=world, join=True, start_method="spawn")
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_cached_step_takes_the_whole_step_gradient(world, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "dropout", R.dtype_free_dropout)
    results = _run(world, tmp_path)
    by_mode = {}
    for (case, sizes, zero_stage, mode), res in zip(RUNS[world], results):
        dropout = 0.0 if mode.startswith("nodrop") else 0.1
        init = {n: p.detach().double() for n, p in R.case_module(case, dropout=dropout).named_parameters()}
        got = {n: res["weights"][n] - init[n] for n in init}
        assert res["lr"] == 1.0 and not res["skipped"]
        by_mode[mode] = got
        if mode.endswith(("full", "accum")):
            continue
        want, want_loss = _expected_update(case, world, sizes, dropout=dropout)
        unused = set(got) - set(want)  # no gradient in the reference (the pooler under mean pooling): not moved
        assert unused and all(float(got[n].abs().max()) == 0.0 for n in unused)
        assert R.mismatch({n: got[n] for n in want}, want) == [], (case, sizes, zero_stage)
        # The logged loss: the whole step's (x world size per rank, so the mean over ranks is it).
        assert res["loss"] == pytest.approx(want_loss, rel=1e-5), (case, sizes, zero_stage)
    if world == 2:  # without dropout: DeepSpeed's own step on the whole batch agrees, micro-batch negatives do not
        assert R.mismatch(by_mode["nodrop_cached"], by_mode["nodrop_full"]) == []
        bad = R.mismatch(by_mode["nodrop_accum"], by_mode["nodrop_full"])
        assert any(b.startswith("model.projection.") for b in bad), bad
