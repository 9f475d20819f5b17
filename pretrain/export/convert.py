"""`pretrain-convert`: our checkpoints <-> Hugging Face BERT, RoBERTa (RobertaPreLayerNorm for pre-LN) or ModernBERT /
sentence-transformers directories.

    pretrain-convert to-hf CHECKPOINT OUT_DIR [--pooling mean] [--no-mlm-head] [--overwrite]
    pretrain-convert from-hf HF_DIR OUT [--overwrite]

CHECKPOINT is a run directory, its checkpoints/ directory, a checkpoint tag (any ZeRO stage;
no DeepSpeed scripts needed) or a from-hf init directory. A sentence-transformers model's modules
(pooling, Dense, Normalize) survive both ways; to-hf also writes a model card (README.md).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from pretrain.checkpoint.store import CheckpointError
from pretrain.console import set_verbose
from pretrain.export.hf import (
    export_hf,
    load_init_weights,
    write_init_dir,
)
from pretrain.export.hf_tokenizer import write_clean_tokenizer
from pretrain.export.model_card import build_model_card, run_record
from pretrain.export.recorded import matryoshka_dims, recorded_pooling
from pretrain.export.resolve import (
    load_hf_model,
    open_hf_dir,
    open_weights,
    select_checkpoint,
)
from pretrain.export.st_modules import ST_POOLING
from pretrain.model import POOLINGS, PretrainModel

__all__ = ["from_hf", "load_checkpoint_model", "load_hf_model", "load_init_weights", "main", "to_hf"]


def _open_ours(checkpoint: str, trust: bool):
    w = open_weights(checkpoint, trust=trust)
    if w.kind not in ("checkpoint", "init_dir"):
        raise ValueError(f"{checkpoint} is a Hugging Face directory, not one of our checkpoints; it is already in "
                         f"HF format (to train from it: pretrain-convert from-hf {checkpoint} OUT)")
    return w


def load_checkpoint_model(checkpoint: str, *, trust: bool = False) -> tuple[PretrainModel, dict]:
    """(model, resolved run-config dict) from any of our checkpoints or a from-hf init directory."""
    w = _open_ours(checkpoint, trust)
    return w.build_model(), w.run_config


def to_hf(
    checkpoint: str,
    out_dir: str,
    *,
    pooling: str | None = None,
    max_seq_length: int | None = None,
    overwrite: bool = False,
    trust: bool = False,
    mlm_head: bool = True,
) -> None:
    """Export one of our checkpoints as a HF BERT + sentence-transformers directory with a model card.

    The sentence embedding is the one its run evaluated (``recorded_pooling``: eval.pooling, else model.pooling;
    unsupervised SimCSE trains [CLS] through its MLP and evaluates [CLS] before it) through the model's pooler,
    Dense and Normalize, unless ``pooling`` says otherwise; the MLM head (mlm/: when the weights have one and
    their run, if known, trained it) and the projection head are written only when the weights have them."""
    if Path(out_dir).exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists; remove it or pass --overwrite")
    w = _open_ours(checkpoint, trust)
    # The MLM head is exported when it is one: not when the weights lack it (an import of a BertModel), nor when
    # the run that wrote them had no mlm term (then it is whatever it started as, fresh for such an import).
    objective = run_record(w)["config"].get("objective")
    has_head = "mlm_head.dense.weight" in w.state and (objective is None or bool(objective.get("mlm")))
    model = w.build_model(warn_fresh_head=False)  # a head the weights lack is not exported either
    tokenizer = (w.run_config.get("data") or {}).get("tokenizer")
    if not tokenizer:
        raise ValueError(f"{checkpoint}: its config names no data.tokenizer; cannot write tokenizer files")
    max_len = max_seq_length or w.max_seq_length
    if not pooling:  # what the run evaluated with, where a sentence-transformers directory can hold it (not Z)
        recorded = recorded_pooling(w.path)[0]
        pooling = recorded if recorded in ST_POOLING else model.cfg.pooling
    if any(k.startswith("heads.autoencoder.") for k in w.heads):
        warnings.warn(f"{checkpoint} was trained with SARCSE's autoencoder, whose Z is that recipe's sentence "
                      f"embedding; a Hugging Face / sentence-transformers directory cannot hold it, so the export "
                      f"embeds by {pooling} over the encoder alone. Evaluate Z with pretrain-eval --pooling "
                      f"autoencoder_z on the checkpoint.", stacklevel=2)
    heads = {"mlm_head": mlm_head and has_head, "projection": any(k.startswith("projection.") for k in w.state)}
    card = build_model_card(w, pooling=pooling, out_dir=out_dir, **heads)
    export_hf(model, tokenizer, out_dir, pooling=pooling, max_seq_length=max_len, overwrite=overwrite,
              model_card=card, matryoshka_dims=matryoshka_dims(run_record(w)["config"]), **heads)


def from_hf(hf_dir: str, out: str, *, overwrite: bool = False) -> None:
    """Turn a HF BERT / sentence-transformers directory into an init directory (``checkpoint.init_from=OUT``):
    the weights it has (no fresh heads), the model.* settings it states, its max_seq_length as data.max_len."""
    import tempfile

    if Path(out).exists() and not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass --overwrite")
    w = open_hf_dir(hf_dir)
    model = w.build_model(warn_fresh_head=False)  # a head the source lacks is not written (state_keys below)
    data = {"max_len": w.max_seq_length} if w.max_seq_length else {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = write_clean_tokenizer(hf_dir, Path(tmp) / "tokenizer.json")
        write_init_dir(model, tok, out, overwrite=overwrite, state_keys=w.state, model_fields=w.recorded,
                       data=data, source=str(Path(hf_dir).resolve()))


_FAMILY_NAMES = {"bert": "BERT", "roberta": "RoBERTa", "roberta-prelayernorm": "RoBERTa-PreLayerNorm",
                 "modernbert": "ModernBERT"}


def _family_name(hf_dir: str) -> str:
    import json

    model_type = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    return _FAMILY_NAMES.get(model_type, str(model_type))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="our checkpoint -> HF BERT/RoBERTa/ModernBERT (+ sentence-transformers) directory")
    p.add_argument("checkpoint", help="a run directory, one of its checkpoints, or its best/")
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", dest="which", default="latest", metavar="latest|best|step_N",
                   help="with a run directory: its newest checkpoint (default), best/ (best STS-B dev) or "
                        "checkpoints/step_N")
    p.add_argument("--pooling", choices=list(POOLINGS), default=None,
                   help="sentence-transformers pooling (default: the run's eval.pooling, else model.pooling)")
    p.add_argument("--max-seq-length", type=int, default=None, help="default: the run's data.max_len")
    p.add_argument("--no-mlm-head", action="store_true",
                   help="leave out mlm/ (the BertForMaskedLM copy: encoder + MLM head; about doubles the size)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-checkpoint", action="store_true", help="read an old checkpoint of ours that has no model.safetensors by unpickling its DeepSpeed files (runs any code they carry: only for checkpoints you trust)")
    p = sub.add_parser("from-hf", help="HF BERT/RoBERTa/ModernBERT directory -> init directory for checkpoint.init_from")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--overwrite", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="let DeepSpeed's and transformers' messages through")
    args = parser.parse_args(argv)

    set_verbose(args.verbose)
    try:
        if args.command == "to-hf":

            source, reading = select_checkpoint(args.checkpoint, args.which)
            print(reading, flush=True)
            to_hf(str(source), args.out_dir, pooling=args.pooling, max_seq_length=args.max_seq_length,
                  overwrite=args.overwrite, trust=args.trust_checkpoint, mlm_head=not args.no_mlm_head)  # fmt: skip
            print(f"wrote {args.out_dir} (Hugging Face {_family_name(args.out_dir)} + sentence-transformers)")
        else:
            from_hf(args.hf_dir, args.out, overwrite=args.overwrite)
            print(f"wrote {args.out}; train from it with checkpoint.init_from={args.out} "
                  f"data.tokenizer={Path(args.out) / 'tokenizer.json'}")  # fmt: skip
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"pretrain-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
