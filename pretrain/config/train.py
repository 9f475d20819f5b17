"""Optimisation, trainer, checkpoint, distributed and kernel-dispatch configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 0.01
    """Applied to weights only; biases, LayerNorm and embeddings' norms get none."""
    warmup_steps: int = 10000
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    """Decay after warmup, to min_lr_ratio * lr at train.max_steps."""
    min_lr_ratio: float = 0.0
    clip_grad_norm: float = 1.0
    """0 disables clipping."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0 or self.warmup_steps < 0 or self.clip_grad_norm < 0:
            raise ValueError("optim.eps must be > 0 and optim.weight_decay, warmup_steps, clip_grad_norm >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(kw_only=True)
class SpikeConfig:
    """What counts as a loss spike or a burst of non-finite steps; either rolls the run back to its last good
    checkpoint and skips the samples since (training/spikes.py, docs/operations.md "Loss spikes")."""

    detector: Literal["ratio", "zscore", "none"] = "ratio"
    """How a step's loss is judged against the finite losses of the ``window`` steps before it: ratio: above
    ``ratio`` x their median; zscore: more than ``zscore`` standard deviations above their mean; none: never
    (not "off", which YAML reads as false)."""
    ratio: float = 2.0
    zscore: float = 6.0
    min_rise: float = 0.5
    """A spike must also lie this many nats above that median (or mean): near zero a ratio or a z-score alone flags
    noise (a contrastive loss the batch has solved going from 0.005 to 0.015 is 3x its median); 0 = off."""
    window: int = 100
    """Steps of loss history the detector compares with, and the window ``bad_in_window`` counts over."""
    min_history: int = 20
    """No loss is judged before the window holds this many finite losses (after the start or a rollback's
    window from the checkpoint: the history is part of the checkpoint)."""
    bad_in_window: int = 4
    """This many steps with a non-finite loss or gradient within the last ``window`` steps roll back; 0 = off
    (each one alone is skipped; train.max_bad_steps consecutive ones stop the run)."""
    max_rollbacks: int = 3
    """Rollbacks to the same checkpoint before the run falls back to the newest older one kept (the damage may
    predate that checkpoint), and, once every kept checkpoint has had as many, stops (exit 3): not the data's."""

    def __post_init__(self) -> None:
        if self.ratio <= 1.0 or self.zscore <= 0 or not self.min_rise >= 0:
            raise ValueError(f"train.spike.ratio must be > 1, train.spike.zscore > 0 and train.spike.min_rise >= 0, "
                             f"got {self.ratio}, {self.zscore}, {self.min_rise}")
        if self.window < 2 or not 2 <= self.min_history <= self.window:
            raise ValueError(f"train.spike.window must be >= 2 and train.spike.min_history in [2, window], got "
                             f"{self.window}, {self.min_history}")
        if self.bad_in_window < 0 or self.max_rollbacks < 1:
            raise ValueError(f"train.spike.bad_in_window must be >= 0 (0 = off) and train.spike.max_rollbacks >= 1, "
                             f"got {self.bad_in_window}, {self.max_rollbacks}")


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps."""
    micro_batch_size: int = 32
    """Sequences per rank per forward pass."""
    grad_accum: int = 1
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    """auto: bf16 where the device computes it fast (a CUDA GPU of compute capability >= 8.0, ROCm with bf16, or a
    CPU with AMX-BF16), fp32 elsewhere (other CPUs: bf16 ran 14x slower than fp32 at tiny size on a 2-core x86 CPU
    without AMX). Resolved when the config is loaded (``load_run_config``), so config.yaml and checkpoints record
    what ran."""
    log_every: int = 10
    eval_every: int = 0
    """Validation every N steps on data.valid (0 = only at the end)."""
    eval_batches: int = 20
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss spikes and bursts of non-finite steps: detected, rolled back, their samples skipped."""
    compile: bool = False
    """torch.compile a micro-batch's forward and loss terms as one graph (``TrainModule.compile_step``: every
    encoder pass, pooling, projection, the MLM head and the losses; no graph break and no host sync inside, so
    it can be captured as a CUDA graph). The counts' reduction over ranks, backward and the optimizer step stay
    eager, and so does validation (only the training step enters the compiled function). The first steps compile,
    and a new batch shape once more until dynamic shapes take over (the sequence length and the number of MLM
    positions vary per batch; every attention mask is applied, so which rows are full is no guard). Unpadded
    (train.unpadded) under compile_shapes dynamic or auto, in the ``fixed`` attention layout (unpadded_attention);
    padded under static and bucketed. Under ZeRO-3 the whole
    module gathers its parameters once before the compiled forward and once before the backward (DeepSpeed's
    leaf-module mode, ``Engine``) instead of module by module, where DeepSpeed's hooks would break the graph:
    parameter memory in the step is then the whole model's, as at ZeRO 1-2, with gradients and optimizer states
    still partitioned. (A CUDA graph there, compile_mode=reduce-overhead, is untested: ZeRO-3 gathers into new
    memory every step.)"""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (fused kernels) in training; tests use aot_eager (no C++ build)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode; reduce-overhead captures the step as CUDA graphs (a GPU; one graph per distinct input
    shape, see compile_shapes)."""
    compile_shapes: Literal["auto", "dynamic", "static", "bucketed"] = "dynamic"
    """dynamic: symbolic from the start, one graph for every batch (on the CPU inductor adds a second for batches past
    4,096 reduced elements, chosen by size, docs/performance.md), the same graph whichever step a process starts
    at, so a resumed run computes what the uninterrupted one did bit for bit (docs/operations.md); auto: static
    until a shape changes, then dynamic (torch.compile's dynamic=None; the default until 2026-11-28: a resumed run
    began with a static graph where the uninterrupted one had long gone dynamic, and rounded differently from
    there); static: a graph per shape (what CUDA graphs record anyway). Padded batches change shape every step
    (longest row, masked positions), so static recompiles until torch's recompile limit, then runs eagerly.
    bucketed: static graphs over a few shapes, for compile_mode=reduce-overhead on real data (under auto or dynamic
    CUDA graphs still record one graph per distinct size): each batch's widths padded up to a multiple of
    ``compile_bucket`` tokens (at most the model's positions), its MLM positions up to a multiple of
    ``compile_bucket`` with unlabelled tokens whose loss is ignored (training/step.py: Buckets). The same losses
    and gradients; the padding costs arithmetic where a batch's rows are shorter than their bucket."""
    compile_bucket: int = 64
    """compile_shapes=bucketed: the width and MLM-position multiple (seq 128: widths 64 or 128)."""
    unpadded: bool = True
    """The training step runs the MLM rows and the contrastive pair unpadded: each micro-batch's sequences packed
    into one token stream on the host (model/packing.py), so embeddings, linear layers, LayerNorm, FFN and the MLM
    head compute no padding and attention nearly none, each sequence attending only to itself. The same losses
    and gradients as the padded path up to float rounding (tests/unit/test_unpadded.py); dropout draws other
    noise. On by default because real batches are padded (16% of the MLM rows' tokens on the shared books and wiki,
    docs/performance.md); false runs the padded path, which validation, evaluation and export always use. Under
    train.compile the step is unpadded with compile_shapes dynamic or auto (the ``fixed`` layout below: the same
    structure every batch, one graph), padded with static or bucketed (CUDA graphs' few shapes)."""
    unpadded_attention: Literal["auto", "groups", "varlen", "fixed"] = "auto"
    """How the unpadded step attends (model/packing.py): ``groups`` runs the stream's sequences in at most 16
    groups of nearly equal length, each one SDPA (any device, both architectures); ``varlen`` runs one attention
    call a layer over the stream's cumulative lengths (BERT only, as a ModernBERT local layer's window is a mask
    that path does not take): on CUDA in bf16/fp16 aten's flash attention called directly, else SDPA over nested
    jagged tensors (on the CPU that loops over sequences with a host read each: tests only; the start-up banner
    warns where a run would take it); ``fixed`` always runs 4 groups, each masked, of two rows or more (more
    padding than ``groups``, the same structure for every batch: what a compiled step traces once). ``auto``: fixed
    under train.compile, else groups. On the H200 (2026-11-28, docs/performance.md) varlen through nested jagged
    tensors ran at 0.65-0.71x the groups' speed, its host busy with the nested tensors' Python dispatch; the direct
    flash call that replaced it there is not measured yet."""
    trim_last_layer: bool = True
    """The training step's MLM and pair passes compute their last layer only for the tokens a loss reads: the MLM
    rows' labelled tokens (about 15%) and, under [CLS] pooling with no mean pooling blended in and no autoencoder,
    each contrastive row's [CLS] (the pair's, and data.pairs' hard negatives'). That layer still computes keys and
    values for every token (the kept ones attend to all), and its output projection, FFN and norms for the kept
    rows only, as MosaicBERT's last layer does; eagerly on the CPU also its queries (BERT and ModernBERT) and,
    for BERT over attention groups, its attention (model/attention.py: ``project_qkv``,
    ``SelfAttention._attend_rows``) for the kept rows only: the same losses and gradients up to float rounding
    (tests/unit/test_trim_last_layer.py), about 70% of one layer's arithmetic saved (a sixth of a 4-layer model's, a
    twelfth of BERT-base's encoder's at the CLEAR recipe's lengths). Unpadded, padded and compiled steps alike.
    Dropout in that layer draws other noise than the full layer (fewer elements). false computes every token's
    output."""
    joint_pass: bool = True
    """With an objective of MLM and a contrastive term of CLEAR's views (no gradient cache), the MLM rows and both
    views go through the encoder as one stream instead of two passes: every layer runs once per micro-batch, so
    half the kernel launches and per-layer host work (and, under ZeRO-3, half the module fetches), over matrix
    products twice as tall. Unpadded, the stream is packed with one set of attention groups for both; padded (and
    so compiled), it is the two padded batches end to end, each attended to at its own width (static shapes: one
    graph). Each sequence still attends only to itself; the same losses and gradients as two passes up to float
    rounding (tests/unit/test_joint_pass.py); dropout draws other noise. false runs the two passes."""
    pin_memory: bool = True
    """On CUDA, each micro-batch's host tensors (the loader's and the host's packing facts) are copied into pinned
    memory before their asynchronous copy to the GPU. From pageable memory the driver stages the copy and may
    first wait for the stream (CUDA's API synchronisation rules), so the host could not run ahead into the next
    step while the GPU finishes this one; DataLoader's pin_memory and Hugging Face's Trainer pin for the same
    reason. No effect on the CPU. The GPU pass measures it against false (``tools/bench_step.py --ab pin``)."""
    fast_dropout: bool = True
    """Dropout on the CPU in one pass of a C kernel whose mask is a counter's hash (model/dropout.py: a 64-bit key
    from torch's generator, SplitMix64 of key + word, 16 bits per element; nothing stored for the backward, which
    computes the mask again) instead of torch's per-element Bernoulli sample and stored mask (torch's dropout was a
    tenth of a mini model's CPU step, docs/performance.md): the drop probability is rounded to a multiple of
    1/65536 and the kept values scaled by the exact inverse, keyed by (seed, step, rank) like torch's. The attention
    probabilities' dropout too (SDPA's CPU math path written out). CUDA and compiled steps use torch's dropout
    either way, and so do tensors under 8k elements (``dropout.FAST_MIN_NUMEL``: there the mask's fixed host cost
    exceeds torch's), except the unpadded path's attention groups, whose masks are runs of one key a layer. false:
    torch's dropout on the CPU as well (other noise, the same distribution up to that rounding)."""
    flat_params: bool = True
    """Each encoder layer's parameters held in two flat tensors (decayed and not) instead of 16 (model/flat.py):
    DeepSpeed's per-parameter work (gradient hooks, bucket copies, norms, casts) and the optimizer's run on 2 tensors
    a layer, so the host dispatches far fewer ops a step; the arithmetic, the state dict's names, exports and
    evaluation are unchanged. ZeRO 0-2; ZeRO-3 keeps per-tensor parameters (it gathers and frees them per module).
    A resumed run keeps the layout its checkpoint was written with (one from before 2026-11-25: per-tensor);
    resumes are bitwise on any rank count (the views are remade at every micro-step: ``flat.release_views``)."""

    flat_scope: Literal["encoder", "layer"] = "encoder"
    """With train.flat_params: "encoder" holds all the encoder layers' parameters in one pair of flat tensors,
    "layer" a pair per layer (the layout until 2026-12-06). One pair leaves DeepSpeed ZeRO 0-2 22 fewer tensors to
    hook, copy and update at BERT-base depth (18 instead of 40), ~10% of the eager step's host time
    (docs/performance.md); the layers' gradients then reach it at the end of the encoder's backward, together.
    A resumed run keeps the scope its checkpoint was written with (one from before 2026-12-06: "layer")."""

    malloc_mmap_threshold_kib: int = 1 << 20
    """glibc's mmap threshold in KiB, fixed for the trainer process (training/heap.py; its trim threshold at twice
    it); 0 leaves glibc's dynamic threshold, which stops rising at 32 MiB. The default, 1 GiB, serves every
    activation from the heap and keeps it there between steps, where glibc's default maps each tensor over 32 MiB
    (BERT-small's FFN activations, the MLM logits) afresh at every step and faults its pages in again (measured:
    BERT-small's CPU step 5-8% faster with it, the same peak RSS; docs/performance.md). A small value (128) does the
    opposite: every freed block goes straight back to the system, which keeps a cached-gradient step's peak RSS flat
    (1.11x with glibc's default, 0.98x with 128 for a cached 2,048 in 8 chunks) but costs page faults on every large
    allocation (the quickstart at 0.70x the samples/s); ``malloc_trim_chunks`` is the cheaper cure. A
    ``MALLOC_MMAP_THRESHOLD_`` in the environment wins. No effect without glibc, or on GPU memory."""

    malloc_trim_chunks: bool = True
    """Under objective.gradient_cache on a CPU: glibc's ``malloc_trim`` after each chunk's backward, so the heap gives
    back what the chunk's activations freed before the next chunk (of another token count) allocates its own;
    without it, the peak RSS of a cached step grows with its number of chunks (measured: a cached 2,048 in 8 chunks
    of 256 peaked at 1.11x an uncached 256 without, 1.01x with; docs/performance.md). Once a chunk, not once an
    allocation as malloc_mmap_threshold_kib. No effect without glibc, on a GPU, or without the gradient cache."""

    @property
    def step_unpadded(self) -> bool:
        """Whether the training step runs unpadded: ``unpadded``, except under ``compile`` with static or bucketed
        shapes (see above)."""
        return self.unpadded and not (self.compile and self.compile_shapes in ("static", "bucketed"))

    def unpadded_layout(self, arch: str) -> str | bool:
        """What the training step's ``unpadded`` is for ``model.arch``: False
        where it runs padded (``step_unpadded``), else its attention layout (model/packing.py's ``LAYOUTS``),
        ``unpadded_attention`` with auto as fixed under ``compile`` and groups otherwise.
        varlen with another architecture is a ValueError (a ModernBERT local layer's window is a mask, which that
        path does not take), and so is groups or varlen under ``compile`` (a new graph for every batch, or none)."""
        if self.unpadded_attention == "varlen" and arch != "bert":
            raise ValueError(f"train.unpadded_attention=varlen is for model.arch=bert; model.arch={arch} attends per "
                             "group (a local layer's window is a mask the varlen path does not take): set "
                             "train.unpadded_attention=groups or auto")
        if not self.step_unpadded:
            return False
        if self.compile and self.unpadded_attention in ("groups", "varlen"):
            why = "its number of groups" if self.unpadded_attention == "groups" else "nested tensors do not trace"
            raise ValueError(f"train.unpadded_attention={self.unpadded_attention} with train.compile=true: each batch "
                             f"would be a new graph ({why}); the compiled step attends in the fixed layout: set "
                             "train.unpadded_attention=auto or fixed (or train.unpadded=false)")
        if self.compile and self.unpadded_attention == "auto":
            return "fixed"
        return "groups" if self.unpadded_attention == "auto" else self.unpadded_attention

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum", "log_every", "max_bad_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.compile_bucket <= 0:
            raise ValueError(f"train.compile_bucket must be positive, got {self.compile_bucket}")
        if self.eval_every < 0 or self.eval_batches < 0:
            raise ValueError("train.eval_every and train.eval_batches must be >= 0")
        if self.malloc_mmap_threshold_kib < 0:
            raise ValueError(f"train.malloc_mmap_threshold_kib must be >= 0 (0 = glibc's default), got "
                             f"{self.malloc_mmap_threshold_kib}")


CPUINFO = "/proc/cpuinfo"
"""Where ``cpu_computes_bf16_fast`` reads the CPU's flags (Linux)."""


def cpu_computes_bf16_fast(cpuinfo: str | None = None) -> bool:
    """This CPU has AMX-BF16 (Intel Xeon from the 4th generation, Sapphire Rapids, on): oneDNN runs PyTorch's bf16
    matrix products on its tile unit. On a 2-core Sapphire Rapids-class VM, a (8192, 256) x (256, 768) product ran at
    3.4 TFLOP/s in bf16 against 0.12 in fp32, and the trainer's step in bf16 at 1.28x / 1.78x / 2.21x / 1.94x its fp32
    speed at tiny / mini / small / base (docs/performance.md; the quickstart's tiny run, vocabulary 8,192, at 0.75x:
    bf16 pays at the recipes' sizes, not at the smallest). Without AMX, avx512_bf16 runs one large product at
    under 2x fp32's rate (327 against ~180 GFLOP/s on the project's 2-core AMD EPYC) and older CPUs emulate bf16,
    so bf16's elementwise cost decides: the tiny CLEAR recipe ran 14x slower than in fp32. Read from ``cpuinfo``
    (default ``CPUINFO``); False where it cannot be read."""
    try:
        with open(cpuinfo or CPUINFO, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in text.splitlines())


def device_computes_bf16_fast() -> bool:
    """A CUDA GPU with bf16 tensor cores (compute capability >= 8.0: A100, H100, RTX 30xx on), a ROCm GPU with bf16,
    or, with no GPU, a CPU with AMX-BF16 (``cpu_computes_bf16_fast``); not other CPUs, where PyTorch's bf16 matrix
    products are emulated or run no faster than fp32."""
    import torch

    if not torch.cuda.is_available():
        return cpu_computes_bf16_fast()
    if getattr(torch.version, "hip", None):
        return torch.cuda.is_bf16_supported()
    return torch.cuda.get_device_capability()[0] >= 8


def resolve_precision(precision: str, fast_bf16: bool | None = None) -> str:
    """train.precision as it will run: "auto" -> "bf16" if ``fast_bf16`` (default: this machine's device, see
    ``device_computes_bf16_fast``) else "fp32"; any other value unchanged."""
    if precision != "auto":
        return precision
    if fast_bf16 is None:
        fast_bf16 = device_computes_bf16_fast()
    return "bf16" if fast_bf16 else "fp32"


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 1000
    """Save every N steps (and at the end); 0 = only at the end."""
    every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (or the launch); 0 = off. Rank 0's clock
    decides, at a step boundary."""
    background: bool = True
    """Write, hash, consolidate (model.safetensors) and publish each checkpoint on a background thread after an
    in-memory snapshot, so training goes on meanwhile (the next save, the end of the run and a stop signal wait for
    it). false: every save finishes before training continues (the same files, written at once)."""
    keep_last: int = 3
    """Checkpoints kept: the newest keep_last intact ones (older ones are removed once a newer one is published; a
    damaged one does not count)."""
    keep_every: int = 0
    """Also keep, for good, every checkpoint whose step is a multiple of this (milestones of a long run: 50000
    keeps steps 50k, 100k, ...; each is a whole checkpoint on disk); 0 = off. A multiple of checkpoint.every."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the run directory's latest complete checkpoint if there is one."""
    init_from: str = ""
    """Start weights from this checkpoint (ours, or converted from HF) without its optimizer/data state."""
    fresh_pooler: bool = False
    """With init_from: BERT's pooler (dense + tanh over [CLS], SimCSE's MLP with pooling cls) starts from a fresh
    init (normal(0, model.init_std), zero bias, drawn from the run's seed) instead of the checkpoint's weights.
    SimCSE's code builds its MLP anew on a BertModel without the pooler (ArcCSE's and RankCSE's build on it), so its
    MLP does not start as bert-base's NSP-trained pooler; the paper does not say. Needs model.pooler: true."""
    trust: bool = False
    """Allow reading init_from / RankCSE teachers from an old checkpoint of ours without model.safetensors by
    unpickling its DeepSpeed files (runs any code they carry: only for checkpoints you trust)."""
    allow_other_data: bool = False
    """Resume a checkpoint on a training set other than the one it was trained on (another dataset at the same path,
    a re-preprocessed corpus, other data.sources weights): refused by default, since the run would go on at the
    checkpoint's sample position in the new set's order. true: go on so, with a warning."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ValueError(f"checkpoint.every must be >= 0 and checkpoint.keep_last >= 1, got {self.every}, {self.keep_last}")
        if self.keep_every < 0 or (self.keep_every and (not self.every or self.keep_every % self.every)):
            raise ValueError(f"checkpoint.keep_every must be 0 (off) or a multiple of checkpoint.every={self.every} "
                             f"(only steps that are saved can be kept), got {self.keep_every}")
        if not self.every_minutes >= 0 or self.every_minutes == float("inf"):
            raise ValueError(f"checkpoint.every_minutes must be a finite number >= 0 (0 = off), got "
                             f"{self.every_minutes!r}")


@dataclass(kw_only=True)
class DistributedConfig:
    zero_stage: int = 2
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on GPU, gloo on CPU."""
    timeout_s: int = 600
    """Collective timeout; a dead rank makes the others fail within this time instead of hanging."""
    peer_timeout_s: int = 30
    """Multi-node jobs: a node whose ranks send no heartbeat for this long is lost (crashed, cut off the network),
    and the others exit at once naming it and the last good checkpoint (distributed/peers.py); 0 = off."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"distributed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.timeout_s <= 0:
            raise ValueError(f"distributed.timeout_s must be positive, got {self.timeout_s}")
        if self.peer_timeout_s < 0:
            raise ValueError(f"distributed.peer_timeout_s must be >= 0 (0 = off), got {self.peer_timeout_s}")


@dataclass(kw_only=True)
class OpsConfig:
    similarity: Literal["auto", "cuda", "torch", "eager"] = "auto"
    """In-batch similarity/softmax implementation: fused CUDA kernel, chunked torch, or eager."""
    chunk_size: int = 1024
    """Column tile of the chunked torch path."""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"ops.chunk_size must be positive, got {self.chunk_size}")


def evaluation_pooling(eval_pooling: str, model_pooling: str, autoencoder: bool) -> str:
    """The sentence embedding a run evaluates (and selects best/) with: eval.pooling, else SARCSE's Z in a run with
    an autoencoder (its inference embedding, Sec. 2.2), else model.pooling. pretrain-eval and pretrain-convert read
    a checkpoint's recorded config by the same rule."""
    return eval_pooling or ("autoencoder_z" if autoencoder else model_pooling)


@dataclass(kw_only=True)
class EvalConfig:
    stsb_every: int = 0
    """STS-B dev Spearman every N steps during training (SimCSE evaluates every 250 steps, ArcCSE and RankCSE
    every 125); 0 = off."""
    data_dir: str = ""
    """Directory holding sts/STSBenchmark (the shared data dir); empty = $PRETRAIN_DATA_DIR, else ../shared/data
    (from the working directory, then beside the repository): the rule every tool follows."""
    pooling: str = ""
    """Pooling for evaluation (cls, cls_before_pooler, mean, first_last_avg, autoencoder_z: SARCSE's Z); empty =
    model.pooling, or SARCSE's Z (its inference embedding) in a run with objective.reconstruction."""
    max_len: int = 128
    keep_best: bool = True
    """Write the best-scoring weights to <run_dir>/best/ (loadable by pretrain-eval/-convert, init_from)."""

    def __post_init__(self) -> None:
        if self.stsb_every < 0 or self.max_len < 8:
            raise ValueError(f"eval.stsb_every must be >= 0 and eval.max_len >= 8, got {self.stsb_every}, {self.max_len}")
        if self.pooling not in ("", "cls", "cls_before_pooler", "mean", "first_last_avg", "autoencoder_z"):
            raise ValueError(f"eval.pooling {self.pooling!r} is not one of cls, cls_before_pooler, mean, "
                             f"first_last_avg, autoencoder_z (or empty: model.pooling, or SARCSE's Z with "
                             f"objective.reconstruction)")
