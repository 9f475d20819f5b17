"""train.compile in the trainer's own step (real Engine, CPU, gloo): one graph, no graph break, and the same losses
as the eager step, step after step, at ZeRO 0, 2 and 3 (ZeRO-3 with every parameter partitioned between uses: the
whole module gathers around the compiled region, ``Engine``). Dropout is off
(the compiled graph draws its noise in another order); the runs take the padded path (train.unpadded=false) except
where a test says unpadded (the compiled step's ``fixed`` attention layout); aot_eager (train.compile_backend)
traces the same graph as inductor without building C++ kernels, whose fusions would round differently. A run that
more than one test reads is made once a module (``once``)."""

from __future__ import annotations


import pytest
import torch
from torch._dynamo.utils import counters
from zero3_partitioned import partitioned

from pretrain.config import load_run_config
from pretrain.model.packing import FIXED_GROUPS
from pretrain.distributed.env import (
    destroy_process_group,
    init_process_group,
    single_process_env,
)
from pretrain.training.trainer import Trainer

STEPS = 3


def _losses(overrides: list[str], steps: int = STEPS, shapes: set | None = None,
            groups: int | None = None) -> tuple[list[float], int]:
    """The loss of each of the trainer's first ``steps`` steps, and the number of graphs torch.compile made;
    ``shapes`` collects each batch's (input_ids, mlm_positions) shapes as the step's forward sees them. The steps
    must run padded, or with ``groups`` unpadded: the MLM rows and views as one stream in that many attention
    groups (0: any number)."""
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(load_run_config(None, overrides), env)
        forward, losses = trainer.engine.forward, []

        def forward_seen(batch, **kwargs):
            if groups is None:
                assert "packed_mlm" not in batch  # the padded path, compiled or not
            else:
                assert groups in (0, len(batch["packed_joint"].groups)), batch["packed_joint"].groups
            loss, metrics = forward(batch, **kwargs)
            losses.append(loss.detach().clone())
            if shapes is not None:
                shapes.add((tuple(batch["input_ids"].shape), tuple(batch["mlm_positions"].shape)) if groups is None
                           else tuple((g.num_rows, g.length) for g in batch["packed_joint"].groups))
            return loss, metrics

        trainer.engine.forward = forward_seen
        torch._dynamo.reset()
        counters.clear()
        loader = iter(trainer._loader(trainer.train_set, 0))
        trainer.engine.train()
        for _ in range(steps):
            trainer.train_step(loader)
        assert not counters["graph_break"], dict(counters["graph_break"])
        return [float(x) for x in losses], counters["stats"]["unique_graphs"]
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()


PADDED = {"data__valid": "[]", "model__dropout": 0.0, "model__attention_dropout": 0.0, "train__unpadded": "false",
          "train__compile_backend": "aot_eager"}
"""The padded runs' overrides (ZeRO-2, the default stage): no validation set, no dropout, train.unpadded=false."""

EAGER_STEPS = 6
"""Steps of the eager ZeRO-2 padded run (``_eager_zero2``): the bucketed test's six, the first STEPS for the rest."""


@pytest.fixture(scope="module")
def once(tmp_path_factory):
    """fn(key, run) -> run(a fresh directory), run once a module for each key, in the first test that asks (so
    under that test's clean_env): runs that more than one test reads."""
    done = {}

    def get(key: str, run):
        if key not in done:
            done[key] = run(tmp_path_factory.mktemp(key))
        return done[key]

    return get


def _eager_zero2(once, tiny_overrides) -> tuple[list[float], int, set]:
    """The eager padded ZeRO-2 run's EAGER_STEPS losses, its number of graphs (0) and each batch's shapes
    (``_losses``): the reference of the bucketed run and, its first STEPS, of the ZeRO-2 compiled one
    (test_compiled_step_gives_the_eager_losses[2]): the schedule is train.max_steps's, not the steps run."""

    def run(run_dir):
        shapes = set()
        losses, graphs = _losses(tiny_overrides(run_dir, **PADDED), EAGER_STEPS, shapes)
        return losses, graphs, shapes

    return once("eager_zero2", run)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_compiled_step_gives_the_eager_losses(zero_stage, tmp_path, tiny_overrides, clean_env, monkeypatch, once):
    """ZeRO-2's eager arm is the run the bucketed test compares with too (``_eager_zero2``, its first STEPS)."""
    if zero_stage == 3:  # every parameter partitioned between uses (at these sizes DeepSpeed would keep them whole)
        from pretrain.distributed import engine as engine_mod

        monkeypatch.setattr(engine_mod, "build_ds_config", partitioned(engine_mod.build_ds_config))
    common = {**PADDED, "distributed__zero_stage": zero_stage}
    if zero_stage == 2:
        eager, no_graphs, _ = _eager_zero2(once, tiny_overrides)
        eager = eager[:STEPS]
    else:
        eager, no_graphs = _losses(tiny_overrides(tmp_path / "eager", **common))
    compiled, graphs = _losses(tiny_overrides(tmp_path / "compiled", train__compile="true", **common))
    assert no_graphs == 0 and graphs == 1  # shapes symbolic from the start (train.compile_shapes=dynamic)
    assert len(eager) == STEPS
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_the_views_mean_pool_warmup_compiles_one_graph_for_it_and_traces_each_once(tmp_path, tiny_overrides,
                                                                                  clean_env):
    """objective.nt_xent.mean_pool_warmup_steps under train.compile: the views' weight changes every warm-up step
    and reaches the compiled step as one tensor (``TrainModule.set_view_mean_mix``), so the warm-up is one graph
    and the steps after it (no blend) one more, not a graph a step; and torch traces each graph once (with the
    model's floats as symbols it traced the whole step twice: compile_attempt_1). The losses are the eager step's."""
    from torch._dynamo.utils import compilation_time_metrics

    common = {**PADDED, "model__pooling": "cls", "objective__nt_xent__mean_pool_warmup_steps": 2}
    eager, _ = _losses(tiny_overrides(tmp_path / "eager", **common), steps=4)
    compilation_time_metrics.clear()
    compiled, graphs = _losses(tiny_overrides(tmp_path / "compiled", train__compile="true", **common), steps=4)
    attempts = {k: len(v) for k, v in compilation_time_metrics.items() if k.startswith("compile_attempt_")}
    assert graphs == 2 and attempts == {"compile_attempt_0": 2}, (graphs, attempts)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_the_compiled_step_runs_unpadded_in_one_graph_with_the_eager_losses(arch, tmp_path, tiny_overrides,
                                                                            clean_env):
    """train.unpadded (the default) under train.compile: the MLM rows and both views as one stream in
    FIXED_GROUPS attention groups, every batch's groups of other sizes (each group's rows, its longest length, the
    stream's tokens), and still one graph, no break, and the eager unpadded step's losses (its groups layout: other
    groups, the same arithmetic on the real tokens). ModernBERT at window 8: the band (model/banded.py) in groups
    longer than 20 tokens, the dense window mask in shorter ones; whether the window covers a group and whether the
    half window divides its length were guards (a recompile whenever a batch's groups crossed them)."""
    common = {"data__valid": "[]", "model__dropout": 0.0, "model__attention_dropout": 0.0,
              "train__compile_backend": "aot_eager", "train__max_steps": 5}
    if arch == "modernbert":
        common.update(model__arch="modernbert", model__pooler="false", model__local_window=8,
                      model__layer_norm_eps=1e-5)
    shapes = set()
    eager, no_graphs = _losses(tiny_overrides(tmp_path / "eager", **common), steps=5, groups=0)
    compiled, graphs = _losses(tiny_overrides(tmp_path / "compiled", train__compile="true", **common), steps=5,
                               shapes=shapes, groups=FIXED_GROUPS)
    assert len(shapes) == 5, shapes  # every step's groups differed
    assert no_graphs == 0 and graphs == 1
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_validation_before_the_first_step_leaves_the_training_step_one_graph(tmp_path, tiny_overrides, clean_env):
    """The trainer validates at step 0 before it trains. Validation batches come without the host's facts, so in
    the compiled function their MLM gather breaks the graph, and torch.compile then skips that function for good:
    on the H200 (2026-11-27) every later training step ran eagerly with its callees compiled one by one. The step
    must stay one graph after validation, and batches of new shapes (and of other full masks) must not recompile
    it: under train.compile_shapes=dynamic (the default) the first step's graph is every step's, so a resumed
    process, whatever step it starts at, runs the graph the uninterrupted one ran (under auto the first shape got
    a static graph of its own, then the next a dynamic one: a run resumed at step k began static where the
    uninterrupted run was dynamic, and rounded differently under inductor)."""
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    steps = 6
    try:
        trainer = Trainer(load_run_config(None, tiny_overrides(
            tmp_path / "run", train__compile="true", train__compile_backend="aot_eager", train__unpadded="false",
            train__eval_batches=2)), env)
        torch._dynamo.reset()
        counters.clear()
        assert trainer.validate()  # it ran, eagerly
        assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
        shapes, masks = set(), set()
        forward = trainer.engine.forward

        def forward_seen(batch, **kwargs):
            shapes.add((tuple(batch["input_ids"].shape), tuple(batch["mlm_positions"].shape)))
            masks.add(batch["full_masks"])
            return forward(batch, **kwargs)

        trainer.engine.forward = forward_seen
        loader = iter(trainer._loader(trainer.train_set, 0))
        for _ in range(steps):
            trainer.train_step(loader)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert len(shapes) >= 3, shapes  # the batches did change shape (else the recompile bound says nothing)
        assert counters["stats"]["unique_graphs"] == 1, (dict(counters["stats"]), shapes, masks)
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()


@pytest.mark.slow
def test_bucketed_shapes_compile_few_static_graphs_with_the_eager_losses(tmp_path, tiny_overrides, clean_env, once):
    """train.compile_shapes=bucketed: batches of changing width and MLM count run as a few static graphs (what
    CUDA graphs need: each is recorded once) with the eager step's losses."""
    steps = EAGER_STEPS
    bucketed_shapes = set()
    eager, _, raw = _eager_zero2(once, tiny_overrides)  # the eager padded ZeRO-2 run, shared (``once``)
    bucketed, graphs = _losses(tiny_overrides(tmp_path / "bucketed", train__compile="true",
                                              train__compile_shapes="bucketed", train__compile_bucket=32, **PADDED),
                               steps, bucketed_shapes)
    assert len(raw) >= 4, raw  # the batches' shapes do change: a graph per new one without buckets
    # Tiny runs: widths up to 64 -> bucket 64; MLM counts -> 1-2 buckets of 32; a graph per bucketed shape.
    assert len(bucketed_shapes) <= 2 and 1 <= graphs <= len(bucketed_shapes), (graphs, bucketed_shapes)
    # Six steps at other shapes (widths and MLM positions padded to their buckets) than the eager run's: the matrix
    # products round differently, and AdamW turns rounding noise in near-zero gradients into whole steps. Alone
    # this test's step-6 losses differ by 1e-7-2e-7 relative; a full CI run once gave 1.26e-5 (2026-11-27).
    torch.testing.assert_close(torch.tensor(bucketed), torch.tensor(eager), rtol=1e-4, atol=0)
