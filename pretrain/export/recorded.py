"""What a model directory records about its sentence embedding, read back for the tools that take defaults from it:
the pooling its run evaluated with (``pretrain-eval --pooling auto``, ``pretrain-convert to-hf``) and its
Matryoshka sizes (``--dims auto``, the model card)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pretrain.config.train import evaluation_pooling


EVAL_POOLINGS = ("cls", "cls_before_pooler", "mean", "first_last_avg", "autoencoder_z")
"""Every sentence embedding a reader can evaluate (``autoencoder_z``: SARCSE's Z, from a checkpoint's heads)."""


def recorded_pooling(path: str | os.PathLike) -> tuple[str | None, str]:
    """(the sentence embedding a model directory is evaluated with, where that comes from) for ``--pooling auto``:
    a checkpoint's or best/'s run config gives the run's evaluation pooling (``evaluation_pooling``: what its STS-B
    dev evaluation and best/ used); a sentence-transformers directory gives None (its Pooling module decides, read
    when the model loads); a HF directory of ours gives its recorded ``pretrain.pooling``; any other (a HF BERT, or
    an import of one that states no pooling) gives cls_before_pooler, SimCSE's evaluation of BERT's [CLS]. A
    recorded value that is not a pooling is a ValueError naming the file."""
    import yaml

    p = Path(path)
    if (p / "modules.json").is_file() and (p / "config.json").is_file():
        return None, "the sentence-transformers model's Pooling module"
    for name in ("run_config.yaml", "config.yaml"):
        if (p / name).is_file():
            config = yaml.safe_load((p / name).read_text(encoding="utf-8")) or {}
            sections = [config.get(k) or {} for k in ("eval", "model", "objective")]
            if not all(isinstance(s, dict) for s in sections):
                raise ValueError(f"{p / name}: its eval, model and objective entries must be mappings")
            ev, model, objective = sections
            pooling = evaluation_pooling(str(ev.get("pooling") or ""), str(model.get("pooling") or ""),
                                         bool(objective.get("reconstruction")))
            if pooling:  # none stated: an import of a HF BERT (pretrain-convert from-hf), read as that directory
                return _known_pooling(pooling, p / name), f"the run's evaluation pooling, from {p / name}"
            break
    if (p / "config.json").is_file():
        recorded = (json.loads((p / "config.json").read_text(encoding="utf-8")).get("pretrain") or {}).get("pooling")
        if recorded:
            return _known_pooling(str(recorded), p / "config.json"), f"pretrain.pooling of {p / 'config.json'}"
    return "cls_before_pooler", "[CLS] before BERT's pooler, SimCSE's evaluation of a BERT directory"


def _known_pooling(pooling: str, where: Path) -> str:
    if pooling not in EVAL_POOLINGS:
        raise ValueError(f"{where} records pooling {pooling!r}, which is not one of {', '.join(EVAL_POOLINGS)}; "
                         f"pass --pooling")
    return pooling


def matryoshka_dims(run_config: dict | None) -> list[int]:
    """objective.matryoshka.dims of a run config (dict), largest first; [] without Matryoshka."""
    m = ((run_config or {}).get("objective") or {}).get("matryoshka") or {}
    return sorted((int(d) for d in m.get("dims") or []), reverse=True)


def recorded_matryoshka_dims(path: str | os.PathLike) -> list[int]:
    """The Matryoshka sizes a model directory records, largest first: an export's config.json (``pretrain.
    matryoshka_dims``) or a checkpoint's / best/'s run config; [] when none."""
    import yaml

    p = Path(path)
    if (p / "config.json").is_file():
        recorded = (json.loads((p / "config.json").read_text(encoding="utf-8")).get("pretrain") or {})
        return sorted((int(d) for d in recorded.get("matryoshka_dims") or []), reverse=True)
    for name in ("run_config.yaml", "config.yaml"):
        if (p / name).is_file():
            return matryoshka_dims(yaml.safe_load((p / name).read_text(encoding="utf-8")))
    return []
