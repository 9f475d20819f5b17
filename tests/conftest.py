"""Shared fixtures: the real-data directory, a tiny generated corpus, device skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _data_dir() -> Path | None:
    env = os.environ.get("PRETRAIN_DATA_DIR")
    if env:
        return Path(env)
    default = REPO.parent / "shared" / "data"
    return default if default.is_dir() else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """../shared/data (or $PRETRAIN_DATA_DIR); tests using it skip when it is absent."""
    d = _data_dir()
    if d is None or not d.is_dir():
        pytest.skip("real data not found: set PRETRAIN_DATA_DIR to the shared data directory")
    return d


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
