"""Full training step (MLM + CLEAR NT-Xent: forward, backward, optimizer) — ours vs Hugging Face.

Ours: PretrainModel + Objective through the DeepSpeed Engine, exactly as the trainer runs it
(MLM head on masked rows only, SDPA, chunked NT-Xent). HF: ``transformers.BertForMaskedLM``
(full-sequence MLM head, as ``labels=`` computes it) plus the same CLEAR loss written the
usual way (projection MLP, 2N x 2N similarity, cross-entropy), with ``torch.optim.AdamW``.
Same sizes, same synthetic batch, one process per size, alternating trials.

    python tools/bench_step.py --sizes tiny mini --seq 128 --batch 32 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SIZES = {  # configs/models/*.yaml
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, ffn_size=512),
    "mini": dict(hidden_size=256, num_layers=4, num_heads=4, ffn_size=1024),
    "small": dict(hidden_size=512, num_layers=4, num_heads=8, ffn_size=2048),
}


def make_batch(batch: int, seq: int, view_len: int, vocab: int, gen: torch.Generator) -> dict:
    ids = torch.randint(6, vocab, (batch, seq), generator=gen)
    ids[:, 0], ids[:, -1] = 2, 3
    labels = torch.full_like(ids, -100)
    sel = torch.rand(batch, seq, generator=gen) < 0.15
    sel[:, 0] = sel[:, -1] = False
    labels[sel] = ids[sel]
    inp = ids.clone()
    inp[sel] = 4
    mask = torch.ones(batch, seq, dtype=torch.bool)
    va = torch.randint(6, vocab, (batch, view_len), generator=gen)
    vb = torch.randint(6, vocab, (batch, view_len), generator=gen)
    vmask = torch.ones(batch, view_len, dtype=torch.bool)
    return dict(input_ids=inp, attention_mask=mask, mlm_labels=labels, view_a_ids=va, view_a_mask=vmask,
                view_b_ids=vb, view_b_mask=vmask)


def build_ours(size: str, vocab: int, seq: int, zero_stage: int):
    from pretrain.config import DistributedConfig, ModelConfig, ObjectiveConfig, OpsConfig, OptimConfig, TrainConfig
    from pretrain.distributed.engine import Engine
    from pretrain.distributed.env import detect_env, init_process_group
    from pretrain.model import build_model
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.training.optim import build_param_groups, lr_lambda

    env = detect_env()
    init_process_group(env, backend="auto", timeout_s=600)
    mcfg = ModelConfig(vocab_size=vocab, max_position=max(512, seq), pooling="mean", **SIZES[size])
    module = TrainModule(build_model(mcfg), Objective(ObjectiveConfig(), Context(env=env, ops=OpsConfig(),
                                                                                 pooling="mean")))
    optim = OptimConfig(lr=1e-4, warmup_steps=0)
    engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                    train=TrainConfig(micro_batch_size=1), dist=DistributedConfig(zero_stage=zero_stage),
                    env=env, lr_lambda=lr_lambda(optim, 1000))
    engine.train()

    def step(batch):
        loss, _ = engine.forward(batch)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def build_hf(size: str, vocab: int, seq: int, temperature: float = 0.1):
    from transformers import BertConfig, BertForMaskedLM

    s = SIZES[size]
    cfg = BertConfig(vocab_size=vocab, hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                     num_attention_heads=s["num_heads"], intermediate_size=s["ffn_size"],
                     max_position_embeddings=max(512, seq))
    model = BertForMaskedLM(cfg)
    d = s["hidden_size"]
    proj = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))
    params = list(model.parameters()) + list(proj.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    model.train()

    def step(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["mlm_labels"])
        ids = torch.cat([batch["view_a_ids"], batch["view_b_ids"]])
        mask = torch.cat([batch["view_a_mask"], batch["view_b_mask"]])
        h = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        z = F.normalize(proj((h * m).sum(1) / m.sum(1)), dim=-1)
        n2 = z.shape[0]
        sim = z @ z.T / temperature
        sim.fill_diagonal_(float("-inf"))
        target = (torch.arange(n2) + n2 // 2) % n2
        loss = out.loss + F.cross_entropy(sim, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    return step


def time_one(step, batch) -> float:
    t0 = time.perf_counter()
    step(batch)
    return time.perf_counter() - t0


def measure(args, size: str) -> dict:
    """Median seconds per step of ours and HF for one size, alternating trials in this process."""
    batch = make_batch(args.batch, args.seq, args.view_len, args.vocab, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ours = build_ours(size, args.vocab, args.seq, args.zero_stage)
    hf = build_hf(size, args.vocab, args.seq)
    ours(batch), hf(batch)  # warm-up
    t_ours, t_hf = [], []
    for _ in range(args.steps):  # alternate so drifting machine load hits both alike
        t_ours.append(time_one(ours, batch))
        t_hf.append(time_one(hf, batch))
    return {"ours_s": statistics.median(t_ours), "hf_s": statistics.median(t_hf)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "mini"], choices=list(SIZES))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--view-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one size, result as JSON (internal)
    args = p.parse_args(argv)
    if args.json:
        print("RESULT " + json.dumps(measure(args, args.sizes[0])))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch} x seq {args.seq} "
          f"(+2 views x {args.view_len}), vocab {args.vocab}, median of {args.steps} steps")
    rows = []
    for size in args.sizes:
        # One process per size: a DeepSpeed engine and its hooks stay alive until the process ends.
        cmd = [sys.executable, __file__, "--json", "--sizes", size, "--seq", str(args.seq), "--view-len",
               str(args.view_len), "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps",
               str(args.steps), "--zero-stage", str(args.zero_stage)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append((size, 1 / r["ours_s"], 1 / r["hf_s"], r["hf_s"] / r["ours_s"]))
    print("\n| size | ours steps/s | HF steps/s | ours / HF |")
    print("|---|---:|---:|---:|")
    for size, so, sh, r in rows:
        print(f"| {size} | {so:.2f} | {sh:.2f} | {r:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
