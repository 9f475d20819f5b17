"""The aten ops a CUDA training step dispatches, counted on the CPU, on real micro-batches: ours as the trainer
runs it against HF's BertForMaskedLM + the same contrastive loss (``tools/bench_step.py``'s two arms, BERT-base
depth at its host-cost width), one step of each per batch of the shared books (CLEAR's recipe, 128/64, micro-batch
128). An unpadded real batch attends in up to 16 groups (``model/packing.py``), and some of a layer's host work is
per group; ``bench_step.py --host-cost``'s synthetic batch has 2.

On a GPU every op the host dispatches is work for the host (a launch, or a view made in C++); where the CPU step
runs other code than the CUDA step, this counts the CUDA step's:

- the C kernels (``pretrain.model.kernels``: dropout masks, attention probabilities, bias + GELU, the slots' layout,
  the MLM loss, RoPE) are left out, so each module takes the torch path it takes on CUDA;
- ``F.scaled_dot_product_attention`` counts as one op each way (flash or memory-efficient attention on CUDA; its
  math path on the CPU, with dropout, is ~27 ops each way), in both arms, after what aten's front end does to a mask
  before the memory-efficient kernel (the CUDA kernel that takes one), run and counted: a boolean mask converted
  to an additive one, padded and sliced unless its strides are multiples of 8, broadcast (``_efficient_mask``);
- ``F.dropout`` is aten's ``native_dropout`` (one op each way, as on CUDA; the CPU's composes four), in both arms;
- with ``--ab varlen``, a third arm, ours with ``train.unpadded_attention=varlen``: its attention is CUDA's direct
  flash call over the cumulative lengths (``attention.flash_varlen``, bf16), one op each way, a layer's whole
  stream at once where the groups make one SDPA call per group (and their strided views, masks and broadcasts).

Counts only, no time (the CPU's kernels are not CUDA's); the GPU pass measures the time
(``tools/gpu_check.sh``).

    python tools/bench_device_ops.py --batches 3 [--ab varlen]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402  (this directory's)

KERNEL_USERS = ("pretrain.model.block", "pretrain.model.modern_block", "pretrain.model.rotary",
                "pretrain.model.dropout", "pretrain.model.gather", "pretrain.losses.mlm")
"""The modules that call ``kernels.cpu_kernels()`` in a training step (each imported it by name)."""
ATTENTION_OP = "aten.attention_kernel"
"""The name SDPA's one kernel each way is counted under (``_backward`` for its gradient)."""
VARLEN_OP = "aten._flash_attention_forward"
"""The name ``flash_varlen``'s one kernel each way is counted under (``_backward`` for its gradient)."""


def _as_one_op(op: str, fn, tensors) -> tuple[tuple, torch.Tensor]:
    """``fn(*leaves)`` with the op counter set aside, counted as the one op ``op``: ((the leaves made of
    ``tensors``, fn's output), which ``_as_one_op_backward`` differentiates, and that output detached."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        ins = [t.detach().requires_grad_() for t in tensors]
        y = fn(*ins)
        out = y.detach()
    _tick(op)
    return (ins, y), out


def _as_one_op_backward(op: str, graph: tuple, grad: torch.Tensor) -> tuple:
    """The gradients of ``_as_one_op``'s leaves with the op counter set aside, counted as ``op``'s backward."""
    from torch.utils._python_dispatch import _disable_current_modes

    ins, y = graph
    with _disable_current_modes():
        grads = torch.autograd.grad(y, ins, grad)
    _tick(op + "_backward")
    return grads


class _OneKernelAttention(torch.autograd.Function):
    """SDPA run with the op counter set aside, counted as one op forward and one backward."""

    @staticmethod
    def forward(ctx, sdpa, q, k, v, mask, dropout_p, scale):
        ctx.graph, out = _as_one_op(ATTENTION_OP, lambda *qkv: sdpa(*qkv, attn_mask=mask, dropout_p=dropout_p,
                                                                    scale=scale), (q, k, v))
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, *_as_one_op_backward(ATTENTION_OP, ctx.graph, grad), None, None, None)


class _OneKernelVarlen(torch.autograd.Function):
    """``attention.flash_varlen`` (CUDA only) stood in for on the CPU: each sequence's attention computed with the
    op counter set aside (SDPA over nested jagged tensors, as ``nested_attention``), counted as aten's one flash
    op forward and one backward."""

    @staticmethod
    def forward(ctx, q_NHK, k_NHK, v_NHK, cu_B1, max_len, dropout_p):
        from pretrain.model.attention import nested_attention
        from pretrain.model.packing import Packed

        n, h, size = q_NHK.shape

        def nested(*qkv_NHK):
            packed = Packed.__new__(Packed)  # only what nested_attention reads: the lengths
            packed.cu_seqlens_B1, packed.min_length, packed.max_length = cu_B1, int(cu_B1.diff().min()), max_len
            return nested_attention(*(z.reshape(n, h * size) for z in qkv_NHK), packed, h, dropout_p).view(n, h, size)

        ctx.graph, out = _as_one_op(VARLEN_OP, nested, (q_NHK, k_NHK, v_NHK))
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_as_one_op_backward(VARLEN_OP, ctx.graph, grad), None, None, None)


def _efficient_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """What aten's SDPA front end (aten/src/ATen/native/transformers/attention.cpp) does to ``mask`` on CUDA before
    the memory-efficient kernel, here so that its ops are counted: ``convert_boolean_attn_mask`` (a boolean mask
    to 0 / -inf in q's dtype; the same ops on every device), ``preprocess_mask`` (padded to a multiple of 8
    columns and sliced back unless every stride but the last is a multiple of 8 and the last is 1; broadcast to
    the scores' shape)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:  # as torch 2.13's front end does on the CPU too: two scalar tensors and a where
        mask = torch.where(mask, *(torch.scalar_tensor(x, dtype=q.dtype, device=mask.device) for x in (0.0, -math.inf)))
    if mask.stride(-1) != 1 or any(stride % 8 for stride in mask.stride()[:-1]):
        cols = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - cols % 8))[..., :cols]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _tick(name: str) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    if mode is not None and hasattr(mode, "ops"):  # the OpCounter
        mode.ops[name] += 1


@contextlib.contextmanager
def cuda_op_shape():
    """Inside: the C kernels left out, SDPA one op each way, F.dropout aten's native_dropout (module docstring)."""
    import importlib

    from pretrain.model import attention as attention_mod

    sdpa, dropout = F.scaled_dot_product_attention, F.dropout
    saved = [(m, m.cpu_kernels) for m in map(importlib.import_module, KERNEL_USERS)]
    varlen = (attention_mod.flash_varlen_applies, attention_mod.flash_varlen)

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if is_causal or kwargs or not (q.requires_grad and k.requires_grad and v.requires_grad):
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        **kwargs)
        return _OneKernelAttention.apply(sdpa, q, k, v, _efficient_mask(attn_mask, q, k), dropout_p, scale)

    def native(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and 0 < p < 1 else dropout(x, p, training, inplace)

    try:
        for m, _ in saved:
            m.cpu_kernels = lambda: None
        F.scaled_dot_product_attention, F.dropout = attention, native
        attention_mod.flash_varlen_applies = lambda x, head_size: x.dtype in (torch.bfloat16, torch.float16)
        attention_mod.flash_varlen = _OneKernelVarlen.apply
        yield
    finally:
        for m, fn in saved:
            m.cpu_kernels = fn
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
        attention_mod.flash_varlen_applies, attention_mod.flash_varlen = varlen


def count(args) -> dict:
    """Per arm, the ops of one step on each batch (after one warm-up step on every batch: the trainer's loader
    packs each batch before the step, as ``build_ours`` does on a batch's first step)."""
    from pretrain.metrics.op_count import OpCounter
    from pretrain.training.step import HostFacts

    torch.set_num_threads(1)
    size = bench_step.HOST_COST["size"]
    batches = bench_step.real_batches(args.data, args.micro_batch, args.seq, args.view_len, args.batches)
    torch.manual_seed(0)
    with cuda_op_shape():
        arms = {"ours": bench_step.build_ours(size, 30522, args.seq, args.zero_stage, args.precision,
                                              micro_batch=args.micro_batch, fast_dropout=False)}
        fused = bool(arms["ours"].engine._adamw.defaults.get("fused"))
        arms["hf"] = bench_step.build_hf(size, 30522, args.seq, "cpu", args.precision, fused=fused)
        if args.ab == "varlen":  # ours with train.unpadded_attention=varlen: CUDA's flash over cumulative lengths
            arms["ours_varlen"] = bench_step.build_ours(size, 30522, args.seq, args.zero_stage, args.precision,
                                                        micro_batch=args.micro_batch, fast_dropout=False,
                                                        attention="varlen")
        for batch in batches:
            for step in arms.values():
                step(batch)
        res: dict = {arm: [] for arm in arms}
        for batch in batches:
            for arm, step in arms.items():
                with OpCounter() as counter:
                    step(batch)
                res[arm].append({"aten_ops": counter.num_aten, "sync_ops": counter.num_sync,
                                 "attention_calls": counter.ops[ATTENTION_OP] + counter.ops[VARLEN_OP],
                                 "ops": dict(counter.ops)})
    groups = [len(HostFacts("groups", True)(b)["packed_joint"].groups) for b in batches]
    return {"arms": res, "groups": groups, "padding": bench_step.padding_shares(batches)}


def table(result: dict) -> list[str]:
    """Markdown: per arm the mean aten ops a step, SDPA calls, sync ops; ours / HF."""
    arms, lines = result["arms"], []
    lines += ["| arm | aten ops a step | of them attention (one kernel each way) | sync-forcing ops |",
              "|---|---:|---:|---:|"]
    mean = {arm: statistics.mean(r["aten_ops"] for r in rows) for arm, rows in arms.items()}
    for arm, rows in arms.items():
        lines.append(f"| {arm} | {mean[arm]:,.0f} | {statistics.mean(2 * r['attention_calls'] for r in rows):,.0f} | "
                     f"{statistics.mean(r['sync_ops'] for r in rows):.0f} |")
    varlen = f"; ours_varlen / HF {mean['ours_varlen'] / mean['hf']:.2f}x" if "ours_varlen" in mean else ""
    lines += ["", f"ours / HF aten ops: {mean['ours'] / mean['hf']:.2f}x{varlen}; attention groups of ours' joint "
              f"stream per batch: {', '.join(map(str, result['groups']))}; padding of the padded batches: MLM rows "
              f"{result['padding']['mlm']:.1%}, views {result['padding']['views']:.1%}"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=bench_step.DATA_SOURCES, default="books")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--view-len", type=int, default=64)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--ab", choices=["varlen"], default="",
                   help="varlen: a third arm, ours with train.unpadded_attention=varlen (CUDA's direct flash call)")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    bench_step.set_heap("trainer")
    result = count(args)
    print(f"aten ops of a CUDA step counted on the CPU: torch {torch.__version__}, {args.data}, {args.batches} "
          f"batches of {args.micro_batch} ({args.seq} / {args.view_len}), {bench_step.SIZES['host']}, "
          f"{args.precision}, ZeRO-{args.zero_stage}; C kernels left out, SDPA, flash varlen and dropout one op each "
          f"way")
    print("\n".join(table(result)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
