"""Reading a Hugging Face directory's weights: safetensors only (a single file or a sharded index whose shards
must lie inside the directory); weights kept only as a pickle are refused, never unpickled."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pretrain.checkpoint.files import read_safetensors
from pretrain.fsutil import inside


def read_hf_weights(hf_dir: str | os.PathLike) -> dict:
    """All tensors of a HF checkpoint directory (model.safetensors or a sharded index; a pickle only is refused;
    a damaged file is a ValueError naming it)."""
    d = Path(hf_dir)
    if (d / "model.safetensors").is_file():
        return read_safetensors(d / "model.safetensors")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict = {}
        for f in files:
            out.update(read_safetensors(inside(d, f, listed_in=index.name, links=False)))
        return out
    refuse_pickled_weights(d)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {d}")


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def refuse_pickled_weights(d: Path, loader: str = "transformers") -> None:
    """ValueError when ``d`` holds its weights as a pickle only (pytorch_model.bin): a directory handed to us is
    read from safetensors and never unpickled (even torch.load(weights_only=True) runs pickle's machinery on it).
    ``loader``: what the user can re-save it with. Every reader of handed weights (both eval backends, a
    sentence-transformers Dense module) says it this way."""
    for name in PICKLED_WEIGHTS:
        if (d / name).is_file():
            raise ValueError(
                f"{d} holds its weights as {name}, a pickle, and no model.safetensors; pretrain reads safetensors "
                f"only and never unpickles a directory it is handed. Where you trust the file, re-save it: load it "
                f"with {loader} and save_pretrained (save) it again, which writes model.safetensors")
