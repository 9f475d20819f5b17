"""Two gloo ranks on CPUs of different kinds (a written cpuinfo each: with and without AMX-BF16) resolve
``train.precision=auto`` differently; ``train.agree_on_precision`` gives every rank rank 0's, and leaves an explicit
value alone."""

from __future__ import annotations

import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.integration.test_precision_resume import AMX, NO_AMX

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, kinds: tuple[str, str]) -> None:
    from pretrain.config import load_run_config
    from pretrain.config import train as train_config
    from pretrain.distributed.env import DistEnv
    from pretrain.train import agree_on_precision

    cpuinfo = f"{out_dir}/cpuinfo{rank}"
    with open(cpuinfo, "w") as f:
        f.write(kinds[rank])
    train_config.CPUINFO = cpuinfo  # this rank's kind of CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        env = DistEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, node_rank=rank,
                      master_addr="127.0.0.1", master_port=port, launcher="torchrun")
        result = {}
        for asked in ("auto", "fp32"):
            cfg = load_run_config(None, [f"train.precision={asked}"])
            result[asked] = [cfg.train.precision, agree_on_precision(cfg, env).train.precision]
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_0s_resolution_of_auto(tmp_path, capfd):
    if torch.cuda.is_available():
        import pytest

        pytest.skip("the CPU's kind decides auto only without a GPU")
    for kinds, want in (((AMX, NO_AMX), "bf16"), ((NO_AMX, AMX), "fp32")):
        mp.start_processes(_worker, args=(_free_port(), str(tmp_path), kinds), nprocs=WORLD, join=True,
                           start_method="spawn")
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
        own = ["bf16" if kind == AMX else "fp32" for kind in kinds]
        assert [g["auto"] for g in got] == [[own[0], want], [own[1], want]], got
        assert [g["fp32"] for g in got] == [["fp32", "fp32"]] * WORLD, got
        err = capfd.readouterr().err
        assert err.count(f"rank 1: train.precision={want} as rank 0 resolved it") == 1, err
        assert "rank 0: train.precision" not in err, err
