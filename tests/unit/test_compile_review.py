"""train.compile where a user's run would go wrong quietly: the compiled step past torch's recompile limit, and
settings that pass validation but do nothing with it. (The compiled step against the eager one: test_compile.py and
tests/integration/test_compile_step.py.)"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_unpadded import _batch, _train_module

from pretrain.config import load_run_config
from pretrain.config.lint import inert_settings
from pretrain.model import block
from pretrain.training.step import host_facts

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def _torch_gelu_in_eager(monkeypatch):
    """The eager arm computes BERT's GELU with torch's ops, as the graph does (test_compile.py's fixture)."""
    monkeypatch.setattr(block, "_bias_gelu_in_c", lambda *args: False)


def _cut(batch: dict, width: int) -> dict:
    """The batch's MLM rows cut to ``width`` columns (right padding: their masks stay masks of real tokens first)."""
    return {k: v[:, :width] if k in ("input_ids", "attention_mask", "mlm_labels") else v for k, v in batch.items()}


def test_the_compiled_step_past_the_recompile_limit_says_so_once_and_keeps_the_eager_loss():
    """A graph per batch shape (train.compile_shapes static; bucketed with many buckets) reaches torch's recompile
    limit: torch then runs every batch that no graph fits eagerly for the rest of the process, and said so only in
    one line of its log. The step warns once, in the run's own terms, and the batches go on with the eager loss."""
    eager, compiled = _train_module(), _train_module()
    torch._dynamo.reset()
    compiled.compile_step(backend="aot_eager", dynamic=False)
    batch = _batch(0)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for width in (64, 63, 60, 58, 64):  # two graphs, then the limit: two widths past it, one a graph fits
            facts = host_facts(_cut(batch, width))
            losses = [module(facts)[0] for module in (eager, compiled)]
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    said = [str(w.message) for w in caught if "train.compile" in str(w.message)]
    assert len(said) == 1, said
    assert "recompile_limit" in said[0] and "train.compile_shapes=dynamic" in said[0], said[0]
    torch._dynamo.reset()


def _lint(overrides: list[str], recipe: str | None = None) -> list[str]:
    path = None if recipe is None else str(CONFIGS / "recipes" / f"{recipe}.yaml")
    return inert_settings(load_run_config(path, ["optim.warmup_steps=100", *overrides]))


def test_compile_settings_that_do_nothing_or_fall_back_to_eager_are_named():
    """Lines the start-up banner prints for settings that pass validation but do not do what they say: a
    compile_mode under a backend that drops it (torch.compile's aot_eager and eager backends ignore ``mode``, with
    one log line), static shapes (a graph per batch shape until torch's recompile limit, then eager), and bucketed
    shapes with ArcCSE's triplets (their row count, 0 to the micro-batch, is a shape of its own: a graph per count,
    measured: 6 graphs for 6 batches of triplet counts 3, 1, 0, 5, 4, 2)."""
    compiled = ["train.compile=true", "train.unpadded=false"]
    assert any("train.compile_mode=reduce-overhead does nothing with train.compile_backend=aot_eager" in ln
               for ln in _lint(compiled + ["train.compile_mode=reduce-overhead", "train.compile_backend=aot_eager",
                                           "train.compile_shapes=bucketed"]))
    assert _lint(compiled + ["train.compile_mode=max-autotune", "train.compile_shapes=bucketed"]) == []
    assert any("train.compile_shapes=static compiles a graph per batch shape" in ln and "recompile limit" in ln
               for ln in _lint(compiled + ["train.compile_shapes=static"]))
    assert _lint(compiled + ["train.compile_shapes=bucketed"]) == []
    arccse = _lint(["model=tiny", *compiled, "train.compile_shapes=bucketed"], recipe="arccse_bert_base")
    assert any("train.compile_shapes=bucketed with objective.triplet" in ln for ln in arccse), arccse
    assert not any("objective.triplet" in ln for ln in _lint(["model=tiny", *compiled], recipe="arccse_bert_base"))
    assert not any("objective.triplet" in ln
                   for ln in _lint(["model=tiny", *compiled, "train.compile_shapes=bucketed"],
                                   recipe="simcse_unsup_bert_base"))
