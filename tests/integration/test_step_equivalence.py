"""The trainer's default step (every speed option on: train.unpadded, joint_pass, trim_last_layer, flat_params with
flat_scope=encoder, fast_dropout; and the CPU C kernels: bias+GELU / GeGLU, RoPE, the MLM loss, the attention
groups' q/k/v slots; the tied word table's gradient as rows, the decoder in vocabulary chunks) computes the
plainest step: the same loss, the same term sums and the same gradient of every parameter, compared by name (flat
tensors split back with ``flat.unflatten_state``), for model.arch=bert and modernbert, [CLS] and mean pooling, on a
batch of rows and views of very different lengths (real padding everywhere), with dropout 0.

The reference is the plainest step in float64: unpadded, joint_pass, trim_last_layer, flat_params and fast_dropout
false, the tied table's gradient as autograd's dense sum (``PretrainModel.word_rows`` off), where none of the C
kernels runs (they take fp32/bf16 only; the test checks that none did).

Tolerances:
- the default step in float64 against it: only the order of float64 sums differs (measured <= 3e-15 of a tensor's
  largest entry), compared at 1e-11 of it, plus 1e-16 absolute: the key bias's gradient is 0 in exact arithmetic
  (softmax ignores a constant added to a row's scores), both sides hold ~1e-19 of rounding there;
- the default step in fp32 (the C kernels on) against it: fp32 rounding through two layers and the losses. The
  plainest step in fp32 sits at <= 2e-6 of a tensor's largest entry from the float64 one (measured; asserted here as
  the baseline), the default step at the same; both are compared at 1e-5 of it plus 1e-9 absolute (the key bias:
  ~6e-11 of fp32 rounding noise), losses at 1e-6 relative (measured <= 1e-7). Seen when this was written: one
  trimmed row moved by one token (loss off by 4e-5), one gradient tensor scaled by 1 + 1e-4, each fails.

With dropout 0 the attention takes SDPA (``dropout.uses_fast`` asks for p > 0), so the C attention probabilities
(the path every step with attention dropout takes) are forced in one variant: ``uses_fast`` without its p > 0
condition, whose mask at p = 0 keeps every element at scale 1 (``_rate``), so the step computes the same function.

The last test runs the trainer's step itself (``training.step.optimizer_step`` on the real Engine, as
tools/bench_step.py's ``build_ours`` builds it, ZeRO 0 and 2) and reads the gradients DeepSpeed holds at the update.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from pretrain.config import DistributedConfig, ModelConfig, ObjectiveConfig, OpsConfig, OptimConfig, TrainConfig
from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
from pretrain.model import build_model, dropout, heads
from pretrain.model.dropout import set_fast_dropout
from pretrain.model.flat import layout_of, unflatten_state
from pretrain.model.kernels import cpu_kernels
from pretrain.model.model import PretrainModel
from pretrain.objective import Context, Objective, TrainModule
from pretrain.training.build import apply_param_layout, flat_params_apply
from pretrain.training.step import HostFacts, dropout_rng, step_facts, to_device

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels (pretrain.model._kernels) are not built")

V = 300
"""Vocabulary: with ``DECODER_CHUNK`` set to 64 below, the decoder runs in 5 chunks (the last one partial)."""
PLAIN = dict(unpadded=False, joint_pass=False, trim_last_layer=False, flat_params=False, fast_dropout=False)
"""The plainest step's train.* options."""
CASES = [("bert", "cls"), ("bert", "mean"), ("modernbert", "cls"), ("modernbert", "mean")]
ZERO_STAGE = 2
"""The trainer's default distributed.zero_stage (flat parameters apply below ZeRO-3)."""


def _model_cfg(arch: str, pooling: str) -> ModelConfig:
    """Tiny, two layers, dropout 0. ModernBERT: layer 0 global, layer 1 (the trimmed last one) local with a window
    of 8 under rows of up to 32 tokens."""
    kw = dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
              dropout=0.0, attention_dropout=0.0, pooling=pooling, arch=arch)
    if arch == "modernbert":
        kw.update(pooler=False, local_window=8, layer_norm_eps=1e-5)
    return ModelConfig(**kw)


def _rows(lengths, width, gen, pad_id=0):
    ids = torch.randint(5, V, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, pad_id), mask


def _batch(seed: int = 0) -> dict:
    """8 MLM rows of 2-32 tokens (a quarter labelled, 80% of those [MASK]ed, every row one label), two views of
    2-16 tokens each, no two of a pair the same length."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = _rows([32, 2, 19, 32, 5, 31, 9, 24], 32, gen)
    labelled = mask & (torch.rand(mask.shape, generator=gen) < 0.25)
    labelled[:, 1] = True
    labels = torch.where(labelled, ids, -100)
    ids = ids.masked_fill(labelled & (torch.rand(mask.shape, generator=gen) < 0.8), 4)
    view_a, mask_a = _rows([16, 3, 11, 16, 9, 15, 2, 16], 16, gen)
    view_b, mask_b = _rows([14, 4, 16, 6, 9, 2, 13, 16], 16, gen)
    return dict(input_ids=ids, attention_mask=mask, mlm_labels=labels, view_a_ids=view_a, view_a_mask=mask_a,
                view_b_ids=view_b, view_b_mask=mask_b)


def _build(mcfg: ModelConfig, train: TrainConfig, dtype=torch.float32) -> TrainModule:
    """The module as ``training.build.build_train_module`` builds it (the objective's context from train.*), in
    ``dtype``, its layers flattened as ``apply_param_layout`` does before DeepSpeed (ZeRO-2)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(mcfg)
        ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling=mcfg.pooling,
                      trim_last_layer=train.trim_last_layer, joint_pass=train.joint_pass)
        module = TrainModule(model, Objective(ObjectiveConfig(), ctx))
        set_fast_dropout(module, train.fast_dropout)
    module.to(dtype)
    apply_param_layout(module, train, DistributedConfig(zero_stage=ZERO_STAGE))
    return module


def _facts(module: TrainModule, train: TrainConfig, arch: str) -> HostFacts:
    """What the trainer's loader workers prepare each batch with (``Trainer._step_facts``)."""
    return HostFacts(train.unpadded_layout(arch), module.objective.ctx.joint_pass)


def _loss_and_grads(module: TrainModule, train: TrainConfig, arch: str, batch: dict):
    """(loss, term sums, {parameter name: gradient}) of one forward and backward, as ``optimizer_step`` runs them
    (grad_accum 1), all in float64."""
    module.train()
    module.zero_grad(set_to_none=True)
    with dropout_rng(0, 0, 0, "cpu"):
        loss, metrics = module(to_device(step_facts(batch, _facts(module, train, arch)), torch.device("cpu")))
        loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    grads = {n: g.double() for n, g in unflatten_state(grads, layout_of(module)).items()}
    return loss.detach().double(), {k: v[0].detach().double() for k, v in metrics.items()}, grads


class _Spy:
    """Records what the step runs: the C kernels it calls (``cpu_kernels()`` of every pretrain module answered by a
    proxy), each ``PretrainModel.encode`` call's (packed, rows) and the autograd functions of the tied table's rows
    and the chunked decoder."""

    def __init__(self, monkeypatch):
        self.kernels, self.encodes, self.functions = set(), [], set()
        real, spy = cpu_kernels(), self

        class Proxy:
            def __getattr__(self, name):
                spy.kernels.add(name)
                return getattr(real, name)

        proxy = Proxy()
        for name, mod in list(sys.modules.items()):
            if name.startswith("pretrain.") and getattr(mod, "cpu_kernels", None) is cpu_kernels:
                monkeypatch.setattr(mod, "cpu_kernels", lambda: proxy)
        encode = PretrainModel.encode

        def encode_spy(model, *args, packed=None, rows_S=None, **kw):
            self.encodes.append((packed is not None, rows_S is not None))
            return encode(model, *args, packed=packed, rows_S=rows_S, **kw)

        monkeypatch.setattr(PretrainModel, "encode", encode_spy)
        from pretrain.model.embeddings import TiedWord

        for fn in (TiedWord, heads._ChunkedDecoder):
            monkeypatch.setattr(fn, "apply", lambda *a, _f=fn.apply, _n=fn.__name__: self.functions.add(_n) or _f(*a))

    def clear(self):
        self.kernels.clear(), self.encodes.clear(), self.functions.clear()


@contextlib.contextmanager
def _plainest():
    """The reference's tied word table: autograd's dense sum of its two gradients (no ``TiedWord`` rows)."""
    saved = PretrainModel.word_rows
    PretrainModel.word_rows = lambda self: contextlib.nullcontext()
    try:
        yield
    finally:
        PretrainModel.word_rows = saved


def _reference(mcfg: ModelConfig, arch: str, batch: dict, spy: _Spy):
    """The plainest step in float64, with no C kernel run."""
    plain = TrainConfig(**PLAIN)
    spy.clear()
    with _plainest():
        out = _loss_and_grads(_build(mcfg, plain, torch.float64), plain, arch, batch)
    assert spy.kernels == set() and spy.functions == set(), (spy.kernels, spy.functions)
    assert all(e == (False, False) for e in spy.encodes), spy.encodes  # padded, every token of the last layer
    return out


def _assert_close(got, want, rel: float, floor: float, loss_rel: float, what: str) -> float:
    """``got`` (loss, term sums, gradients) equals ``want``: the loss and terms to ``loss_rel``, each gradient to
    ``rel`` of its largest entry plus ``floor``. Returns the largest gradient difference relative to its scale
    (tensors with a scale above 1e-6)."""
    (loss, terms, grads), (loss_w, terms_w, grads_w) = got, want
    torch.testing.assert_close(loss, loss_w, rtol=loss_rel, atol=0, msg=lambda m: f"{what}: loss: {m}")
    assert terms.keys() == terms_w.keys()
    for k in {"mlm", "nt_xent"} & terms_w.keys():  # the terms' sums (the Engine test passes none)
        torch.testing.assert_close(terms[k], terms_w[k], rtol=loss_rel, atol=0, msg=lambda m, k=k: f"{what}: {k}: {m}")
    assert grads.keys() == grads_w.keys(), f"{what}: {sorted(set(grads) ^ set(grads_w))}"
    worst = 0.0
    for name, g in grads_w.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(grads[name], g, rtol=0, atol=rel * scale + floor,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")
        if scale > 1e-6:
            worst = max(worst, float((grads[name] - g).abs().max()) / scale)
    return worst


def _assert_every_option_acted(spy: _Spy, module: TrainModule, arch: str, dtype, c_attention: bool = False):
    """The default step ran unpadded (the joint stream: one encoder pass), the last layer for some rows only, flat
    layers; in fp32 the C kernels and the fast paths around them."""
    assert spy.encodes == [(True, True)], spy.encodes  # train.unpadded + joint_pass + trim_last_layer
    assert flat_params_apply(TrainConfig(), DistributedConfig(zero_stage=ZERO_STAGE))
    assert any(n.endswith("layers.flat_decay") for n, _ in module.named_parameters())  # train.flat_params
    assert all(m.fast_dropout for m in module.modules() if hasattr(m, "fast_dropout"))  # train.fast_dropout
    if dtype == torch.float64:
        return
    want = {"cross_entropy", "cross_entropy_grad", "slot_heads"} | ({"bias_gelu"} if arch == "bert"
                                                                    else {"geglu", "rope"})
    if c_attention:  # the probabilities and their dropout (an all-keep mask at p = 0)
        want |= {"attention_probs", "attention_probs_grad", "scale_masked"}
    assert want <= spy.kernels, f"C kernels not run: {sorted(want - spy.kernels)} (ran: {sorted(spy.kernels)})"
    assert spy.functions == {"TiedWord", "_ChunkedDecoder"}, spy.functions


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setattr(heads, "DECODER_CHUNK", 64)  # the chunked decoder at a vocabulary of 300
    return _Spy(monkeypatch)


@pytest.mark.parametrize("arch, pooling", CASES)
def test_the_default_step_in_float64_equals_the_plainest_step(arch, pooling, spy):
    """The options' logic alone (no C kernel runs in float64): equal up to the order of float64 sums."""
    mcfg, batch, default = _model_cfg(arch, pooling), _batch(), TrainConfig()
    want = _reference(mcfg, arch, batch, spy)
    spy.clear()
    module = _build(mcfg, default, torch.float64)
    got = _loss_and_grads(module, default, arch, batch)
    _assert_every_option_acted(spy, module, arch, torch.float64)
    _assert_close(got, want, rel=1e-11, floor=1e-16, loss_rel=1e-12, what=f"{arch}/{pooling} default float64")


@pytest.mark.parametrize("c_attention", [False, True], ids=["sdpa", "c-attention"])
@pytest.mark.parametrize("arch, pooling", CASES)
def test_the_default_step_with_the_c_kernels_equals_the_plainest_step(arch, pooling, c_attention, spy, monkeypatch):
    """fp32 with the C kernels: the default step and the plainest one are each as close to the float64 plainest
    step as fp32 rounding puts them. ``c_attention``: the attention through the C probabilities at p = 0."""
    mcfg, batch, default = _model_cfg(arch, pooling), _batch(), TrainConfig()
    want = _reference(mcfg, arch, batch, spy)
    plain = TrainConfig(**PLAIN)
    baseline = _assert_close(_loss_and_grads(_build(mcfg, plain), plain, arch, batch), want, rel=1e-5, floor=1e-9,
                             loss_rel=1e-6, what=f"{arch}/{pooling} plainest fp32")
    assert baseline < 5e-6  # the rounding the tolerance is sized to (measured <= 2e-6)
    if c_attention:
        uses_fast = dropout.uses_fast
        monkeypatch.setattr(dropout, "uses_fast", lambda x, p, training, fast, numel=None:
                            uses_fast(x, 0.1 if p == 0 else p, training, fast, numel))
    spy.clear()
    module = _build(mcfg, default)
    got = _loss_and_grads(module, default, arch, batch)
    _assert_every_option_acted(spy, module, arch, torch.float32, c_attention)
    _assert_close(got, want, rel=1e-5, floor=1e-9, loss_rel=1e-6, what=f"{arch}/{pooling} default fp32")


@pytest.mark.parametrize("zero_stage", [0, ZERO_STAGE])
@pytest.mark.parametrize("arch, pooling", [("bert", "cls"), ("modernbert", "mean")])
def test_the_trainers_step_on_the_engine_equals_the_plainest_step(arch, pooling, zero_stage, spy, clean_env):
    """``optimizer_step`` on a real DeepSpeed Engine (ZeRO 0 and 2, fp32), the batch prepared as the loader workers
    prepare it: the loss it returns and the gradients DeepSpeed holds when the update starts (read by name with
    ``safe_get_full_grad``: ZeRO-2 keeps them in its partition), for the default options and the plainest ones."""
    from deepspeed.utils import safe_get_full_grad

    from pretrain.distributed.engine import Engine
    from pretrain.metrics.accumulate import MetricSums
    from pretrain.training.optim import build_param_groups, lr_lambda
    from pretrain.training.step import optimizer_step

    mcfg, batch = _model_cfg(arch, pooling), _batch(1)
    loss_w, _, grads_w = _reference(mcfg, arch, batch, spy)
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    try:
        for train in (TrainConfig(precision="fp32"), TrainConfig(precision="fp32", **PLAIN)):
            spy.clear()
            module = _build(mcfg, train)
            optim = OptimConfig(lr=1e-4, warmup_steps=0)
            engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim, train=train,
                            dist=DistributedConfig(zero_stage=zero_stage), env=env, lr_lambda=lr_lambda(optim, 10))
            engine.train()
            seen, update = {}, engine.step

            def step():  # the gradients the update reads, before it runs
                seen.update({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                             if safe_get_full_grad(p) is not None})
                return update()

            engine.step = step
            facts = _facts(module, train, arch)
            result = optimizer_step(engine, lambda: facts(batch), MetricSums(), env=env, grad_accum=1, seed=0,
                                    step=0, precision="fp32", unpadded=facts.unpadded, joint=facts.joint,
                                    pin_memory=train.pin_memory)
            what = f"{arch}/{pooling} ZeRO-{zero_stage} unpadded={train.unpadded}"
            assert not bool(result.bad), what
            if train.unpadded:
                _assert_every_option_acted(spy, engine.module, arch, torch.float32)
            grads = {n: g.double() for n, g in unflatten_state(seen, layout_of(engine.module)).items()}
            _assert_close((result.loss.double(), {}, grads), (loss_w, {}, grads_w), rel=1e-5, floor=1e-9,
                          loss_rel=1e-6, what=what)
    finally:
        destroy_process_group()
