"""docs/operations.md's "What may change when a run resumes" names every key of the config: a key added to the
config without a decision about resuming fails here."""

from __future__ import annotations

import re
from pathlib import Path

from pretrain.config import RunConfig, to_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## What may change when a run resumes")
    return text[start:text.index("\n## ", start + 1)]


def test_every_config_key_is_named_in_the_resume_lists():
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_*]+)*)`", _section()))
    wildcards = tuple(n[:-1] for n in named if n.endswith(".*"))
    keys = list(_leaves(to_dict(RunConfig())))
    assert len(keys) > 60  # the config really was walked
    missing = [k for k in keys if k not in named and not k.startswith(wildcards)]
    assert missing == [], f"docs/operations.md does not say what happens on resume when these change: {missing}"


def test_the_check_sees_a_missing_key():
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_*]+)*)`", _section().replace("`seed`", "the seed")))
    assert "seed" not in named


def test_a_resume_keeps_the_checkpoints_flat_layout():
    """training/resume.py: checkpoint_param_layout — flat_params and flat_scope come from the checkpoint's config; a
    flat checkpoint from before train.flat_scope is flat a layer; ZeRO-3 cannot take a flat one."""
    import pytest

    from pretrain.config.train import DistributedConfig
    from pretrain.training.resume import checkpoint_param_layout

    cfg = RunConfig()  # flat_params, flat_scope=encoder, ZeRO-2 by default
    assert (cfg.train.flat_params, cfg.train.flat_scope) == (True, "encoder")
    zero2 = {"zero_stage": 2}
    assert checkpoint_param_layout({"train": {"flat_params": True, "flat_scope": "encoder"}, "distributed": zero2},
                                   cfg, Path("t")) == (True, "encoder", "")
    flat, scope, note = checkpoint_param_layout({"train": {"flat_params": True}, "distributed": zero2}, cfg, Path("t"))
    assert (flat, scope) == (True, "layer") and "train.flat_scope=layer: this run continues so" in note
    flat, scope, note = checkpoint_param_layout({"train": {"flat_params": False}, "distributed": zero2}, cfg, Path("t"))
    assert not flat and "per-tensor (train.flat_params=false)" in note
    z3 = RunConfig(distributed=DistributedConfig(zero_stage=3))
    with pytest.raises(ValueError, match="ZeRO-3 cannot load"):
        checkpoint_param_layout({"train": {"flat_params": True}, "distributed": zero2}, z3, Path("t"))
