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
