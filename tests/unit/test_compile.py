"""train.compile: a micro-batch's forward and loss terms trace as one graph (``TrainModule.compile_step``), no graph
break and so no host sync inside, padded and unpadded (the trainer's compiled step takes the fixed layout: the
same structure every batch, tests/integration/test_compile_step.py), for MLM + CLEAR's NT-Xent (BERT and
ModernBERT) and the sentence stage's SimCSE and ArcCSE terms."""

from __future__ import annotations

import functools

import pytest
import torch
from test_unpadded import _batch, _model_cfg, _rows, _train_module

from pretrain.config import ObjectiveConfig, OpsConfig
from pretrain.config.objective import ArcConConfig, InfoNCEConfig
from pretrain.distributed.env import single_process_env
from pretrain.model import block, build_model
from pretrain.objective import Context, Objective, TrainModule
from pretrain.training.step import host_facts


@pytest.fixture(autouse=True)
def _torch_gelu_in_eager(monkeypatch):
    """The eager arms compute BERT's FFN GELU with torch's ops, as the compiled graph does: on the CPU the eager
    step takes the C kernel (model/block.py ``_BiasGelu``), which differs from torch's GELU in the last bits (it is
    nearer float64: test_bias_gelu.py), and these tests compare the two arms' losses and gradients to 1e-5."""
    monkeypatch.setattr(block, "_bias_gelu_in_c", lambda *args: False)


def _sentence_batch(seed=0) -> dict:
    ids, mask = _rows([12, 3, 16, 7], 16, torch.Generator().manual_seed(seed))
    return {"sentence_ids": ids, "sentence_mask": mask}


def _graph_breaks(module: TrainModule, batch: dict) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    out = torch._dynamo.explain(module.objective.run_terms)(module.model, batch, module.heads)
    return out.graph_break_count, [r.reason.splitlines()[0] for r in out.break_reasons]


MODERN = {"arch": "modernbert", "pooler": False, "local_window": 16}
"""model.arch=modernbert with a window under the batch's lengths (rotary tables and window masks in the graph)."""


def _trimmed(module: TrainModule, trim: bool = True) -> TrainModule:
    """The module with train.trim_last_layer's setting in its objective's context (test_unpadded's has it off)."""
    module.objective.ctx.trim_last_layer = trim
    return module


@pytest.mark.parametrize("unpadded, trim", [(False, False), (True, False), (False, True), (True, True),
                                            ("fixed", True)])
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_mlm_and_nt_xent_trace_as_one_graph(unpadded, trim, arch):
    module = _trimmed(_train_module(**(MODERN if arch == "modernbert" else {})), trim)
    assert _graph_breaks(module, host_facts(_batch(), unpadded=unpadded)) == (0, [])


@pytest.mark.parametrize("term", ["info_nce", "arccon"])
def test_simcse_and_arccse_trace_as_one_graph(term):
    torch.manual_seed(0)
    model = build_model(_model_cfg(dropout=0.1), seed=0)
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, **{term: (InfoNCEConfig if term == "info_nce" else ArcConConfig)()})
    ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling="cls", stage="sentences")
    module = TrainModule(model, Objective(cfg, ctx))
    assert _graph_breaks(module, host_facts(_sentence_batch(), unpadded=True)) == (0, [])


def _sentence_module(term: str) -> TrainModule:
    """A sentence-stage module with SimCSE's InfoNCE, ArcCSE's ArcCon, or SARCSE's InfoNCE + reconstruction."""
    from pretrain.config.objective import ReconstructionConfig

    terms = {"info_nce": {"info_nce": InfoNCEConfig()}, "arccon": {"arccon": ArcConConfig()},
             "reconstruction": {"info_nce": InfoNCEConfig(),
                                "reconstruction": ReconstructionConfig(channels=6, integrate_channels=2)}}[term]
    freq = torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.manual_seed(0)
    ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling="cls", stage="sentences")
    return TrainModule(build_model(_model_cfg(), seed=0),
                       Objective(ObjectiveConfig(mlm=None, nt_xent=None, **terms), ctx, token_freq_V=freq / freq.sum()))


@pytest.mark.parametrize("term", ["info_nce", "arccon", "reconstruction"])
@pytest.mark.parametrize("unpadded", [False, True])
def test_the_sentence_stage_step_forces_no_host_sync(term, unpadded):
    """The sentence stage's step (forward, loss, backward) as the trainer hands it a batch (host_facts): no op that
    waits for the device. Two were there: the similarity op's range check of the positives' indices (built by the
    term itself), and SARCSE's count of sentences with content tokens (now the host's) and of their tokens."""
    from pretrain.metrics.op_count import OpCounter

    module = _sentence_module(term)
    ids, mask = _rows([12, 3, 16, 7, 9, 2], 16, torch.Generator().manual_seed(0))
    batch = host_facts({"sentence_ids": ids, "sentence_mask": mask}, unpadded=unpadded)
    loss, metrics = module(batch)  # warm-up
    with OpCounter() as counter:
        loss, metrics = module(batch)
        loss.backward()
    assert counter.num_aten > 50 and counter.num_sync == 0, dict(counter.where)
    if term == "reconstruction":  # the host's count: rows of more than [CLS] and [SEP] (the 2-token row has none)
        assert batch["host_counts"]["reconstruction"] == 5 and metrics["reconstruction"][1] == 5


@pytest.mark.parametrize("term", ["info_nce", "arccon", "reconstruction"])
def test_the_sentence_stage_compiles_one_graph_for_batches_of_other_lengths(term):
    """The compiled step's fixed layout (train.compile's unpadded streams) in the sentence stage: each sentence twice
    in one stream, batches whose groups differ in rows and lengths, one graph (the trainer's dynamic shapes), no
    break, and the eager loss of the same layout; SARCSE's reconstruction reads the stream back in padded rows of
    each batch's width. (MLM + NT-Xent through the trainer: test_compile_step.py.) The eager arm computes with
    torch's ops, as the graph does: the CPU's C GELU differs from torch's in the last bits, and ArcCon's arccos
    turns a 1e-7 change of the activations into 1e-4 of the loss (``_torch_gelu_in_eager``)."""
    from torch._dynamo.utils import counters

    eager, compiled = _sentence_module(term), _sentence_module(term)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_step(backend="aot_eager", dynamic=True)
    groups = set()
    for seed, lengths in enumerate(([12, 3, 16, 7, 9, 5], [16, 16, 2, 11, 4, 8], [5, 6, 7, 8, 9, 10])):  # B fixed
        ids, mask = _rows(lengths, 16, torch.Generator().manual_seed(seed))
        batch = host_facts({"sentence_ids": ids, "sentence_mask": mask}, unpadded="fixed")
        groups.add(tuple((g.num_rows, g.length) for g in batch["packed_sentences"].groups))
        losses = [module(batch)[0] for module in (eager, compiled)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    assert len(groups) == 3 and all(len(g) == 4 for g in groups), groups
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


def _aot_eager_keeping_backward(backward_ops: list[set[str]]):
    """The aot_eager backend (train.compile_backend=aot_eager: the same partitioner, the same nop compilers) that
    also puts each backward graph's ops (``call_function`` targets) in ``backward_ops``, a set a graph."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def keep_backward(gm, example_inputs):
        backward_ops.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return boxed_nop(gm, example_inputs)

    return functools.partial(aot_eager, bw_compiler=keep_backward)


@pytest.fixture(scope="module")
def compiled_steps():
    """fn(trim) -> what test_unpadded's module (train.trim_last_layer as ``trim``) gives eagerly and compiled
    (aot_eager, its backward graphs' ops kept), each arm's first batch then a second (seeds 0 and 1): {"eager":
    [(loss, gradients) a batch], "compiled": [...], "backward_ops": [ops a backward graph]}. Computed once a module,
    in the first test that asks (under its ``_torch_gelu_in_eager``), without trim then with it after one
    torch._dynamo.reset(): the first batch traces a static graph and the second a dynamic one, which the trimmed
    module's compile then starts from (Dynamo's automatic dynamic shapes, a state of the traced function's code),
    as the two parametrizations of test_compiled_step_gives_the_eager_loss_and_gradients did one after the other.
    That test compares the arms, the ZeRO-3 anchor test takes the untrimmed compiled arm's first batch as its
    anchor-free step, and the embedding gradient test (BERT) reads its first backward graph."""
    done = {}

    def steps(trim: bool) -> dict:
        if not done:
            torch._dynamo.reset()
            for each in (False, True):
                backward_ops = []
                eager, compiled = _trimmed(_train_module(), each), _trimmed(_train_module(), each)
                compiled.compile_step(backend=_aot_eager_keeping_backward(backward_ops))
                out = {"eager": [], "compiled": [], "backward_ops": backward_ops}
                for seed in (0, 1):  # a second batch: other masked positions, the cached graph (or a dynamic one)
                    batch = host_facts(_batch(seed))
                    for arm, module in (("eager", eager), ("compiled", compiled)):
                        module.zero_grad(set_to_none=True)
                        loss, _ = module(batch)
                        loss.backward()
                        out[arm].append((loss.detach(), {n: p.grad for n, p in module.named_parameters()
                                                         if p.grad is not None}))
                done[each] = out
        return done[trim]

    return steps


@pytest.mark.parametrize("trim", [False, True])
def test_compiled_step_gives_the_eager_loss_and_gradients(trim, compiled_steps):
    """aot_eager: the traced graph itself, without inductor's kernels (whose fusions round differently); with
    train.trim_last_layer the graph indexes the last layer's rows by the host's positions. Two batches: other
    masked positions, the cached graph (or a dynamic one) runs (``compiled_steps``)."""
    steps = compiled_steps(trim)
    assert len(steps["eager"]) == len(steps["compiled"]) == 2
    for (loss_e, grads_e), (loss_c, grads_c) in zip(steps["eager"], steps["compiled"]):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("trim", [False, True])
def test_a_term_without_a_count_gives_its_parameters_zero_gradients_eager_as_compiled(trim):
    """A micro-batch without a masked position: the weighting dropped the MLM term outside the compiled graph, so the
    compiled step's backward gave the MLM head zero gradients and the eager step none, which AdamW at ZeRO-0 skips
    (no weight decay, no moment update) where it updates them compiled. Both give zeros now, as ZeRO 1-2 do."""
    eager, compiled = _trimmed(_train_module(), trim), _trimmed(_train_module(), trim)
    compiled.compile_step(backend="aot_eager")
    batch = _batch(0)
    batch["mlm_labels"][:] = -100
    batch = host_facts(batch)
    grads = []
    for module in (eager, compiled):
        module.zero_grad(set_to_none=True)
        loss, metrics = module(batch)
        assert metrics["mlm"][1] == 0 and torch.isfinite(loss)
        loss.backward()
        grads.append({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    head = [n for n, _ in eager.named_parameters() if ".mlm_head." in n]
    assert head and all(n in grads[0] and not grads[0][n].any() for n in head), sorted(grads[0])
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_compiled_steps_embedding_gradient_is_atens_kernel(arch, compiled_steps):
    """In the compiled step's backward graph the word embedding's gradient is ``pretrain::embedding_grad`` (an op
    inductor keeps whole and runs as aten's deterministic kernel), not ``embedding_dense_backward``, which inductor
    turns into a scatter with atomic adds (see the next test). BERT's graph is ``compiled_steps``'s (the padded
    step's first batch), ModernBERT's is compiled here with the same backend."""
    if arch == "bert":
        backward_ops = compiled_steps(False)["backward_ops"]
    else:
        backward_ops = []
        module = _train_module(**MODERN)
        module.compile_step(backend=_aot_eager_keeping_backward(backward_ops))
        loss, _ = module(host_facts(_batch(), unpadded=False))
        loss.backward()
    first = backward_ops[0]
    # (The graph's one index_put, the backward of the similarity op's gather of each row's positive, adds to
    # distinct rows: a permutation.)
    assert "pretrain.embedding_grad.default" in first
    assert not {op for op in first if "embedding" in op and op != "pretrain.embedding_grad.default"}


def test_inductor_sums_an_embeddings_gradient_without_atomic_adds():
    """Inductor itself (C++ kernels, 2 threads), an Embedding looked up with many repeats: no ``atomic_add`` in
    the generated code (nn.Embedding's lookup has one: its threads add a repeated token's rows in the order they
    arrive, so identical compiled runs differ in the last bits), and the gradient equals the eager one bit for
    bit."""
    from torch._inductor.utils import run_and_get_code

    from pretrain.model.embeddings import Embedding

    torch.manual_seed(0)
    table = Embedding(50, 64)
    ids = torch.randint(0, 5, (32, 128))
    scale = torch.arange(64.0)

    def loss_of(ids):
        return (table(ids) * scale).sum()

    loss_of(ids).backward()
    eager = table.weight.grad.clone()
    table.weight.grad = None
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compiled = torch.compile(loss_of, backend="inductor")
        _, code = run_and_get_code(lambda: compiled(ids).backward())
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert code and not any("atomic_add" in c for c in code)
    assert any("embedding_grad" in c for c in code)
    assert torch.equal(table.weight.grad, eager)


def test_the_zero3_anchor_leaves_the_loss_alone_and_gets_its_gradient_from_the_compiled_graph(compiled_steps):
    """Under ZeRO-3 the compiled step takes a 0-dim anchor (``Engine.forward``): the loss and every gradient are
    the anchor-free step's bit for bit, and the anchor's gradient (zero) comes out of the compiled backward. The
    anchor-free step is ``compiled_steps``'s compiled arm on its first batch (the same module, batch and backend)."""
    loss_p, grads_p = compiled_steps(False)["compiled"][0]
    anchored = _train_module()
    anchored.compile_step(backend="aot_eager")
    batch = host_facts(_batch())
    anchor = torch.zeros((), requires_grad=True)
    loss_a, _ = anchored(batch, anchor)
    loss_a.backward()
    assert torch.equal(loss_a, loss_p)
    names = [name for name, _ in anchored.named_parameters()]
    assert set(grads_p) <= set(names), sorted(set(grads_p) - set(names))
    for name, q in anchored.named_parameters():
        assert (name not in grads_p) == (q.grad is None), name
        assert q.grad is None or torch.equal(q.grad, grads_p[name]), name
    assert anchor.grad is not None and float(anchor.grad) == 0.0
    assert _anchor_reached_by_compiled(loss_a)  # (no graph break with it: tests/distributed/test_zero_step.py)


def _anchor_reached_by_compiled(loss: torch.Tensor) -> bool:
    """Whether the anchor (an AccumulateGrad leaf) hangs off the compiled region's backward node."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and type(child).__name__ == "AccumulateGrad" and child.variable.dim() == 0 \
                    and "CompiledFunction" in type(node).__name__:
                return True
            todo.append(child)
    return False


def test_modernbert_groups_on_both_sides_of_the_band_threshold_compile_one_graph():
    """ModernBERT's local layers take the band from 6 half-windows on and the dense window mask below. Chosen by
    each attention group's symbolic length inside the compiled step, that choice was a guard per group, and each
    batch whose groups fell on other sides of it than the traced one's compiled a new graph (ModernBERT's usual
    1024-token batches at window 128 reached torch's recompile limit, then ran eagerly). ``compile_band`` fixes the
    choice for the run's longest sequence: one graph, the eager loss (both masks are exact)."""
    from torch._dynamo.utils import counters

    from pretrain.model.modern import compile_band

    def module():
        torch.manual_seed(0)
        cfg = _model_cfg(arch="modernbert", local_window=4, global_every=2, pooler=False)  # band from 11 tokens
        ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling="cls", stage="sentences")
        return TrainModule(build_model(cfg, seed=0),
                           Objective(ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig()), ctx))

    eager, compiled = module(), module()
    torch._dynamo.reset()
    counters.clear()
    compile_band(compiled.model, 16)
    compiled.compile_step(backend="aot_eager", dynamic=True)
    for seed, lengths in enumerate(([16, 3, 14, 7, 9, 5], [8, 9, 2, 10, 4, 6], [12, 13, 15, 16, 14, 12])):
        ids, mask = _rows(lengths, 16, torch.Generator().manual_seed(seed))
        batch = host_facts({"sentence_ids": ids, "sentence_mask": mask}, unpadded="fixed")
        losses = [m(batch)[0] for m in (eager, compiled)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    torch._dynamo.reset()
