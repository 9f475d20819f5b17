"""Two gloo ranks open the same dataset: rank 0 builds and caches the sample index, rank 1 only maps it."""

from __future__ import annotations

import json
import shutil
import socket

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, directory: str, out: str) -> None:
    from pretrain.data.sample_index import index_cache_path, load_or_build_sample_index
    from pretrain.data.shards import ShardedDataset
    from pretrain.distributed.env import DistEnv
    from pretrain.training.build import main_rank_first

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        env = DistEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, node_rank=0,
                      master_addr="127.0.0.1", master_port=port, launcher="torchrun")
        with main_rank_first(env):
            src = ShardedDataset(directory)
            existed = index_cache_path(src, 62).exists()
            index = load_or_build_sample_index(src, 62)
        first, end = index.ranges(np.arange(len(index)))
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"existed": existed, "memmap": isinstance(index.starts, np.memmap), "n": len(index),
                       "sum": int(end.sum() + first.sum())}, f)
    finally:
        dist.destroy_process_group()


def test_rank0_builds_the_index_rank1_maps_it(tiny_corpus, tmp_path):
    d = tmp_path / "train"
    shutil.copytree(tiny_corpus["train"], d, ignore=shutil.ignore_patterns("index-cache"))
    mp.start_processes(_worker, args=(_free_port(), str(d), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert not r0["existed"] and r1["existed"]  # rank 1 arrived after rank 0 had written the cache
    assert r0["memmap"] and r1["memmap"] and (r0["n"], r0["sum"]) == (r1["n"], r1["sum"])
    assert len(list((d / "index-cache").glob("samples-*.npy"))) == 1
