"""The start-up banner and --dry-run: parameter counts, the ZeRO memory formula, and a dry run that writes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import load_run_config
from pretrain.train import main
from pretrain.training.banner import GIB, memory_estimate, parameter_counts


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=True)
        self.head.weight = self.embed.weight  # tied: counted once, in the first part that holds it
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_parameter_counts_count_tied_weights_once_and_skip_frozen():
    parts = parameter_counts(_Tied())
    assert parts == {"embed": 40, "head": 10}


@pytest.mark.parametrize("precision,stage,want", [
    ("fp32", 0, 16.0), ("fp32", 1, 4 + 4 + 8 / 8), ("fp32", 2, 4 + 12 / 8), ("fp32", 3, 16 / 8),
    ("bf16", 0, 16.0), ("bf16", 1, 2 + 2 + 12 / 8), ("bf16", 2, 2 + 14 / 8), ("fp16", 3, 16 / 8),
])
def test_model_state_memory_follows_the_zero_paper(precision, stage, want):
    """Bytes per parameter of weights + gradients + Adam state: 16 unsharded, 16/N under ZeRO-3, and the
    ZeRO-1/2 splits (Rajbhandari et al. 2020, Fig. 1: 2+2+12 in mixed precision)."""
    cfg = load_run_config(None, [f"train.precision={precision}", f"distributed.zero_stage={stage}"])
    cfg = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, mlm=None))
    P = 10_000_000
    est = memory_estimate(cfg, P, 8, vocab_size=1000)
    states = est["weights"] + est["gradients"] + est["optimizer"]
    assert states * GIB / P == pytest.approx(want)
    assert est["activations"] > 0 and est["total"] == pytest.approx(states + est["activations"])
    # Activations grow with the micro-batch, linearly (no logits term without MLM).
    twice = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=2 * cfg.train.micro_batch_size))
    assert memory_estimate(twice, P, 8, 1000)["activations"] == pytest.approx(2 * est["activations"])


def test_dry_run_prints_the_banner_and_writes_nothing(tmp_path, tiny_overrides, capsys):
    run_dir = tmp_path / "run"
    assert main([*tiny_overrides(run_dir), "--dry-run", "--ranks", "4", "train.max_steps=50"]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 32 hidden x 2 heads" in out and "parameters (encoder.embeddings" in out
    assert "x 4 rank(s) =" in out and "ZeRO-" in out and "epochs" in out and "memory per rank" in out
    assert "dry run:" in out and not run_dir.exists()
    assert main([*tiny_overrides(run_dir), "--dry-run", "data.valid=[]", "train.eval_every=3"]) == 0
    assert "warning: train.eval_every=3 does nothing" in capsys.readouterr().out
    # A bad input fails with one line and exit 2, before anything starts.
    assert main([*tiny_overrides(run_dir), "--dry-run", "data.sources=[{name: x, path: /nonexistent}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/nonexistent" in err[0] and not run_dir.exists()
