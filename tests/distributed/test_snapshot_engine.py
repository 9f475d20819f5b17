"""Engine.snapshot with a StoragePool (a background checkpoint) holds DeepSpeed's own state dicts copied, not
serialized, and writes the same bytes as the serialized snapshot, at ZeRO 0-3, fp32 and bf16: a DeepSpeed that
puts something into its checkpoints the copy cannot reproduce makes this test fail (the save itself would fall
back to serializing at once and stay correct)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_zero_step import B, V, _batch, _free_port

from pretrain.config import DistributedConfig, ModelConfig, ObjectiveConfig, OpsConfig, OptimConfig, TrainConfig
from pretrain.distributed.env import DistEnv

CASES = [(0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32")]


def _snapshots(rank: int, port: int, tmp: str, out: str) -> None:
    """Every case in one process (one process group; DeepSpeed's start-up paid once)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      master_addr="127.0.0.1", master_port=port, launcher="torchrun")
        torch.save({case: _case(env, *case, f"{tmp}/{case[0]}-{case[1]}") for case in CASES}, out)
    finally:
        dist.destroy_process_group()


def _case(env, zero_stage: int, precision: str, tmp: str) -> dict:
    """Per save (two, after a step each): the kinds of what the copied snapshot holds, whether each file's bytes
    equal the serialized snapshot's, and the pool's bytes after the write."""
    from pretrain.distributed.snapshot import CopiedState, StoragePool
    from pretrain.distributed.engine import Engine
    from pretrain.model import build_model
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.training.optim import build_param_groups, lr_lambda

    torch.manual_seed(0)
    mcfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_position=64,
                       dropout=0.0, attention_dropout=0.0, pooling="mean")
    module = TrainModule(build_model(mcfg), Objective(ObjectiveConfig(), Context(env, OpsConfig(), "mean")))
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                    train=TrainConfig(micro_batch_size=B, precision=precision), env=env,
                    dist=DistributedConfig(zero_stage=zero_stage), lr_lambda=lr_lambda(optim, 10))
    pool, results = StoragePool(), {}
    for step in range(2):  # the second save reuses the first one's buffers
        loss, _ = engine.forward(_batch())
        engine.micro_step(loss)
        engine.step()
        serialized = engine.snapshot(tmp, f"s{step}", client_state={"step": step})
        copied = engine.snapshot(tmp, f"s{step}", client_state={"step": step}, pool=pool)
        kinds = [type(held).__name__ for _, held in copied]
        # training goes on before the writer runs: the copies must not follow the parameters
        loss, _ = engine.forward(_batch(permute=True))
        engine.micro_step(loss)
        engine.step()
        same = []
        for (path, pieces), (path2, held) in zip(serialized, copied, strict=True):
            sink = _Sink()
            if isinstance(held, CopiedState):
                held.save(sink)
                held.release()
            else:
                sink.parts = held
            same.append(path == path2 and b"".join(sink.parts) == b"".join(pieces))
        results[step] = {"kinds": kinds, "same": same, "pool_bytes": pool.nbytes}
    del engine, module
    return results


class _Sink:
    def __init__(self):
        self.parts = []

    def write(self, data):
        self.parts.append(bytes(data))
        return len(data)

    def flush(self):
        pass


def test_a_copied_snapshot_writes_the_serialized_snapshots_bytes(tmp_path):
    out = str(tmp_path / "results.pt")
    mp.spawn(_snapshots, args=(_free_port(), str(tmp_path / "ckpt"), out), nprocs=1, join=True)
    results = torch.load(out)
    assert set(results) == set(CASES)
    for case, steps in results.items():
        for step, r in steps.items():
            assert r["kinds"] and set(r["kinds"]) == {"CopiedState"}, (case, step, r["kinds"])
            assert all(r["same"]), (case, step, r["same"])
        assert steps[1]["pool_bytes"] == steps[0]["pool_bytes"] > 0, case
