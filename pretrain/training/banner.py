"""What a run is about to do, before it does it: the start-up banner and the per-rank memory estimate.

Printed by the trainer on rank 0 at start and by ``pretrain-train CONFIG --dry-run`` (which builds the model and
the data, prints this and exits without starting DeepSpeed, training or writing a checkpoint).

Memory per rank for model states follows the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and Fig. 1): with Ψ
parameters and Adam, mixed precision holds 2Ψ (16-bit weights) + 2Ψ (16-bit gradients) + 12Ψ (fp32 master
weights, momentum, variance); ZeRO-1 divides the 12Ψ by the ranks, ZeRO-2 also the gradients, ZeRO-3 everything.
fp32 training holds 4Ψ + 4Ψ + 8Ψ with the same divisions. Activations are estimated per micro-batch with the
per-layer count of Korthikanti et al. 2022 (Sec. 4.1: s·b·h·(34 + 5·a·s/h) bytes for 16-bit activations,
twice that in fp32) for each encoder pass, plus the MLM logits of the masked positions. It is an estimate
(±30%): allocator overhead, DeepSpeed's buckets and the communication buffers come on top.
"""

from __future__ import annotations

import math
import os

from pretrain.config.train import cpu_computes_bf16_fast
from pretrain.config.lint import CONTRASTIVE_TERMS, inert_settings
from pretrain.distributed.env import cuda_device_index
from pretrain.model.attention import flash_varlen_refusal
from pretrain.model.kernels import cpu_kernels

GIB = 1024 ** 3

BF16_ON_CPU = ("train.precision=bf16 on a CPU without AMX-BF16: such CPUs emulate bf16 matrix products or run "
               "them at most ~2x fp32's rate, and the tiny CLEAR recipe ran 14x slower than in fp32 on a 2-core x86 "
               "machine (3.5 against 48 samples/s); set train.precision=auto (fp32 here; bf16 on a GPU that "
               "computes it fast or on a CPU with AMX-BF16) or fp32")

NO_CPU_KERNELS = ("the CPU kernels (pretrain.model._kernels, csrc/cpu/model_kernels.c) are not built: dropout, RoPE, "
                  "GeGLU and the MLM loss take torch's slower paths on this CPU (the same arithmetic); install with a "
                  "C compiler present (pip install -e . with gcc) to build them")

VARLEN_NESTED = ("train.unpadded_attention=varlen runs SDPA over nested jagged tensors here ({why}): on a CPU torch "
                 "attends one sequence at a time with a host read each (BERT mini on the books: 2.25x slower than "
                 "the groups on 2 cores, 2026-12-06), on CUDA the nested tensors' Python dispatch kept the H200 "
                 "idle (0.65-0.71x the groups' speed, 2026-11-28); set train.unpadded_attention=auto (groups)")


def varlen_nested_why(cfg) -> str | None:
    """Why this run's ``varlen`` layout takes the nested-tensor path (model/attention.py ``varlen_attention``), or
    None where it calls flash attention directly (``attention.flash_varlen_refusal``'s rule) or does not run varlen
    at all."""
    import torch

    if cfg.train.unpadded_layout(cfg.model.arch) != "varlen":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision, torch.float32)
    return flash_varlen_refusal(torch.device("cuda" if _on_gpu() else "cpu"), dtype,
                                cfg.model.hidden_size // cfg.model.num_heads,
                                dtype_name=f"train.precision={cfg.train.precision}")


def parameter_counts(module) -> dict[str, int]:
    """Trainable parameters per part (the module's second-level names, e.g. ``encoder.embeddings``,
    ``mlm_head``, ``projection``); a parameter shared by two parts (tied weights) counts once, in the first. A
    parameter ZeRO-3 partitioned (the trainer's module once DeepSpeed wrapped it) counts whole: ``ds_numel``, where
    its ``numel()`` is 0 outside a gather."""
    seen: set[int] = set()
    parts: dict[str, int] = {}
    for name, p in module.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        bits = [b for b in name.split(".") if b not in ("model", "module")]
        part = ".".join(bits[:2]) if bits[0] == "encoder" else bits[0]
        parts[part] = parts.get(part, 0) + getattr(p, "ds_numel", p.numel())
    return parts


def _tokens_per_sequence(cfg) -> list[int]:
    """Lengths of the encoder passes a micro-batch's sequence takes (at most): the MLM input and the views."""
    terms = set(cfg.objective.enabled())
    if cfg.data.stage == "sentences":  # sentences are cut to data.view_max_len (data/sentences.py), not max_len
        pair = 3 if cfg.data.pairs else 2  # data.pairs: anchor, positive and (at most) a hard negative
        passes = pair if terms & {"info_nce", "arccon", "consistency", "rank_distill", "reconstruction"} else 1
        triplet = [cfg.objective.triplet.max_len] * 3 if "triplet" in terms else []  # anchor, 20% and 40% masked
        return [cfg.data.view_max_len] * passes + triplet
    lengths = [cfg.data.max_len] if "mlm" in terms else []
    if terms & {"nt_xent", "info_nce", "arccon"}:
        lengths += [cfg.data.view_max_len] * 2
    return lengths or [cfg.data.max_len]


def whole_weights_in_step(cfg) -> bool:
    """ZeRO-3 with the compiled step: every rank gathers the whole model for the step (``Engine``: DeepSpeed's
    leaf-module mode), so its weights count whole, as at ZeRO 0-2."""
    return cfg.distributed.zero_stage >= 3 and cfg.step_compiled


def memory_estimate(cfg, num_params: int, world_size: int, vocab_size: int) -> dict[str, float]:
    """Estimated GiB per rank: ``weights``, ``gradients``, ``optimizer``, ``activations`` and ``total``."""
    mixed = cfg.train.precision in ("bf16", "fp16")
    w, g, o = (2, 2, 12) if mixed else (4, 4, 8)
    stage, n = cfg.distributed.zero_stage, max(1, world_size)
    weights = num_params * w / (n if stage >= 3 and not whole_weights_in_step(cfg) else 1)
    grads = num_params * g / (n if stage >= 2 else 1)
    optim = num_params * o / (n if stage >= 1 else 1)
    m = cfg.model
    act_bytes = 1 if mixed else 2  # multiplier on the 16-bit count
    b = cfg.train.micro_batch_size
    acts = 0.0
    for s in _tokens_per_sequence(cfg):
        acts += m.num_layers * s * b * m.hidden_size * (34 + 5 * m.num_heads * s / m.hidden_size) * act_bytes
    if cfg.objective.mlm is not None:
        masked_len = cfg.data.view_max_len if cfg.data.stage == "sentences" else cfg.data.max_len
        masked = math.ceil(cfg.data.masking.prob * masked_len) * b
        acts += masked * vocab_size * 4 * 2  # logits and their gradient, fp32
    out = {"weights": weights / GIB, "gradients": grads / GIB, "optimizer": optim / GIB, "activations": acts / GIB}
    out["total"] = sum(out.values())
    return out


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def banner_lines(cfg, world_size: int, module, train_set, valid_set) -> list[str]:
    """The start-up banner (``cfg.model`` as built: its vocab_size resolved): model and parameters per part, batch
    and tokens per step, precision and ZeRO, data sizes and the epochs max_steps implies, the objectives, the
    per-rank memory estimate, and a warning line for each setting that cannot act (config/lint.py)."""
    m, t = cfg.model, cfg.train
    vocab_size = m.vocab_size
    parts = parameter_counts(module)
    total = sum(parts.values())
    global_batch = t.micro_batch_size * t.grad_accum * world_size
    lengths = _tokens_per_sequence(cfg)
    lines = [
        f"run {cfg.run_dir}: seed {cfg.seed}, stage {cfg.data.stage}",
        f"model: {m.num_layers} layers x {m.hidden_size} hidden x {m.num_heads} heads, ffn {m.ffn_size}, vocab "
        f"{vocab_size:,}, pooling {m.pooling}; {_count(total)} parameters ("
        + ", ".join(f"{k} {_count(v)}" for k, v in parts.items()) + ")",
        f"batch: micro {t.micro_batch_size} x grad_accum {t.grad_accum} x {world_size} rank(s) = {global_batch:,} "
        f"sequences per step; at most {global_batch * sum(lengths):,} tokens per step "
        f"(encoder passes of <= {' + '.join(map(str, lengths))} tokens per sequence)",
        f"precision {t.precision}, ZeRO-{cfg.distributed.zero_stage}, backend {cfg.distributed.backend}",
    ]
    contrastive = contrastive_batch_line(cfg, world_size)
    if contrastive:
        lines.append(contrastive)
    n_train = len(train_set)
    samples = t.max_steps * global_batch
    epochs = samples / n_train if n_train else float("inf")
    data = f"data: train {n_train:,} samples per epoch"
    if valid_set is not None:
        data += f", valid {len(valid_set):,}"
    lines.append(data + f"; max_steps {t.max_steps:,} x {global_batch:,} = {samples:,} samples = {epochs:.2f} epochs")
    lines.append("objectives: " + ", ".join(f"{name} x{getattr(cfg.objective, name).weight:g}"
                                            for name in cfg.objective.enabled()))
    mem = memory_estimate(cfg, total, world_size, vocab_size)
    lines.append(f"memory per rank (estimate, +-30%): {mem['total']:.2f} GiB = weights {mem['weights']:.2f} + "
                 f"gradients {mem['gradients']:.2f} + optimizer {mem['optimizer']:.2f} (ZeRO-"
                 f"{cfg.distributed.zero_stage} over {world_size}"
                 f"{'; weights whole in the step: train.compile' if whole_weights_in_step(cfg) else ''}) + "
                 f"activations {mem['activations']:.2f} per micro-batch")
    warnings = inert_settings(cfg)
    if cfg.train.precision == "bf16" and not _on_gpu() and not cpu_computes_bf16_fast():
        warnings.append(BF16_ON_CPU)
    if not _on_gpu() and cpu_kernels() is None:
        warnings.append(NO_CPU_KERNELS)
    why = varlen_nested_why(cfg)
    if why:
        warnings.append(VARLEN_NESTED.format(why=why))
    if t.compile and t.compile_mode == "reduce-overhead" and t.compile_backend == "inductor" and not _on_gpu():
        warnings.append("train.compile_mode=reduce-overhead records CUDA graphs, and this run has no GPU: inductor "
                        "skips them and the step runs as compile_mode=default")
    return lines + [f"warning: {line}" for line in warnings]


def contrastive_batch_line(cfg, world_size: int) -> str | None:
    """How many sentences the contrastive terms compare with each other (each one's negatives + 1), and how that
    number is made: a micro-batch, times grad_accum under the gradient cache, times the ranks where the keys are
    gathered. Without the cache, grad_accum > 1 leaves it one micro-batch's (the README's "silently shrinks the
    negatives"; ArcCSE's recipe does that on purpose): the line says so. None without such a term."""
    obj, t = cfg.objective, cfg.train
    compared = [name for name in CONTRASTIVE_TERMS if name in obj.enabled()]
    if not compared:
        return None
    pair = obj.nt_xent or obj.info_nce or obj.arccon
    gathered = world_size > 1 and bool(pair is not None and pair.gather)
    cached = obj.gradient_cache and t.grad_accum > 1
    n = t.micro_batch_size * (t.grad_accum if cached else 1) * (world_size if gathered else 1)
    how = [f"micro {t.micro_batch_size}"]
    how += [f"grad_accum {t.grad_accum} (objective.gradient_cache)"] if cached else []
    how += [f"{world_size} ranks gathered"] if gathered else []
    line = f"contrastive batch: {n:,} sentences compared with each other by {', '.join(compared)} (" + " x ".join(how)
    if t.grad_accum > 1 and not cached:
        line += (f"; each of the step's {t.grad_accum} micro-batches on its own: objective.gradient_cache=true "
                 f"would compare all {n * t.grad_accum:,}")
    return line + ")"


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- does the plan fit?

def free_memory_bytes(device: str) -> int:
    """Memory a new process may still take: the device's free memory for "cuda[:N]", else the host's
    MemAvailable (/proc/meminfo; what the kernel can hand out without swapping)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory_fits(mem: dict[str, float], device: str, *, ranks_per_device: int = 1,
                      free_bytes: int | None = None) -> None:
    """ValueError unless ``ranks_per_device`` processes of ``mem`` GiB each (``memory_estimate``) fit in the free
    memory of ``device`` ("cpu": the host's RAM, shared by the ranks of a node; "cuda:N": that GPU). The message
    gives the estimate, the free memory and what to change, largest part first."""
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    need = mem["total"] * GIB * ranks_per_device
    if need <= free:
        return
    where = "free RAM" if device == "cpu" else f"free memory on {device}"
    per = f"{ranks_per_device} ranks x {mem['total']:.2f} GiB = " if ranks_per_device > 1 else ""
    advice = {
        "activations": "lower train.micro_batch_size (raise train.grad_accum to keep the global batch) or "
                       "data.max_len / data.view_max_len",
        "optimizer": "raise distributed.zero_stage or run on more ranks (ZeRO shards the optimizer state)",
        "gradients": "raise distributed.zero_stage to 2 or 3",
        "weights": "use a smaller model (model=tiny|mini|small) or distributed.zero_stage=3 over more ranks (and "
                   "train.compile=false: the compiled ZeRO-3 step gathers the whole model)",
    }
    parts = sorted(advice, key=lambda k: -mem[k])
    todo = "; ".join(f"{k} {mem[k]:.2f} GiB: {advice[k]}" for k in parts[:2])
    raise ValueError(
        f"the plan does not fit: the memory estimate is {per}{need / GIB:.2f} GiB per {'node' if device == 'cpu' else 'device'} "
        f"(+-30%) against {free / GIB:.2f} GiB {where}. Largest parts: {todo}"
        + ("; or model=tiny to try a recipe on this machine" if device == "cpu" else "") + ".")


def check_plan_fits(cfg, module, world_size: int, env) -> None:
    """``--dry-run``'s last check: this config's per-rank memory estimate (``memory_estimate``, for ``world_size``
    ranks) against what this machine has free: the GPU of this rank, or the host's RAM shared by the node's ranks."""
    mem = memory_estimate(cfg, sum(parameter_counts(module).values()), world_size, cfg.model.vocab_size)
    device = f"cuda:{cuda_device_index(env)}" if _on_gpu() else "cpu"
    check_memory_fits(mem, device, ranks_per_device=1 if _on_gpu() else max(1, env.local_world_size))
