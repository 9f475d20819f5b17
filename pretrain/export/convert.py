"""`pretrain-convert`: our checkpoints <-> Hugging Face BERT, RoBERTa (RobertaPreLayerNorm for pre-LN) or ModernBERT /
sentence-transformers directories.

    pretrain-convert to-hf CHECKPOINT OUT_DIR [--pooling mean] [--no-mlm-head] [--overwrite]
    pretrain-convert from-hf HF_DIR OUT [--overwrite]

CHECKPOINT is a run directory, its checkpoints/ directory, a checkpoint tag (any ZeRO stage;
no DeepSpeed scripts needed) or a from-hf init directory. A sentence-transformers model's modules
(pooling, Dense, Normalize) survive both ways; to-hf also writes a model card (README.md).
OUT never is, holds or lies inside the weights read (a run directory may hold OUT, outside its checkpoints/ and
best/), and --overwrite replaces only an earlier output of the same subcommand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import yaml

from pretrain.checkpoint.store import CheckpointError, checkpoints_dir
from pretrain.console import set_verbose
from pretrain.export.hf import (
    INIT_CONFIG,
    INIT_TOKENIZER,
    INIT_WEIGHTS,
    MLM_SUBDIR,
    PROJECTION_FILE,
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

__all__ = ["check_out_dir", "from_hf", "load_checkpoint_model", "load_hf_model", "load_init_weights", "main", "to_hf"]

HF_EXPORT_NAMES = frozenset({"config.json", "model.safetensors", "pytorch_model.bin", MLM_SUBDIR, PROJECTION_FILE,
                             "README.md", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"})
"""Names a to-hf export holds (hf.py's layout; pytorch_model.bin: older exports), besides its module folders."""
ST_MODULE_DIR = re.compile(r"\d+_[A-Za-z]+")
INIT_EXPORT_NAMES = frozenset({INIT_WEIGHTS, INIT_CONFIG, INIT_TOKENIZER})
"""Names a from-hf init directory holds (a run's best/ adds best.json and run_config.yaml: never one)."""


def is_hf_export(d: Path) -> bool:
    """Whether ``d`` is an earlier to-hf export: only the export's names, and a config.json with our "pretrain"
    settings beside modules.json (a run directory, a checkpoint or another tool's HF model never is one)."""
    names = {p.name for p in d.iterdir()}
    if not names <= HF_EXPORT_NAMES | {n for n in names if ST_MODULE_DIR.fullmatch(n)}:
        return False
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("pretrain"), dict) and (d / "modules.json").is_file()


def is_init_export(d: Path) -> bool:
    """Whether ``d`` is an earlier from-hf output: only an init directory's files, its config.yaml saying
    ``converted_from`` (a run's best/ or a checkpoint never is one)."""
    if not {p.name for p in d.iterdir()} <= INIT_EXPORT_NAMES:
        return False
    try:
        config = yaml.safe_load((d / INIT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and "converted_from" in config


def check_out_dir(out: str, *, inputs: list[Path], keep_out_of: list[Path], overwrite: bool,
                  previous: Callable[[Path], bool], what: str) -> None:
    """ValueError naming ``out`` and why, before anything is written or removed: ``out`` is or holds one of
    ``inputs`` (the output is replaced as a whole), lies inside one of ``keep_out_of`` (directories of weights), or
    exists and is not to be replaced: no ``overwrite``, or not an earlier ``what`` (``previous``; empty is fine)."""
    target = Path(out).resolve()
    for given in inputs:
        src = Path(given).resolve()
        if target == src or target in src.parents:
            relation = "is" if target == src else "holds"
            raise ValueError(f"output {out} {relation} the input {given}, and the output is replaced as a whole; "
                             f"choose an output directory outside it")
    for d in keep_out_of:
        if target == Path(d).resolve() or Path(d).resolve() in target.parents:
            where = "as" if target == Path(d).resolve() else "inside"
            raise ValueError(f"output {out} would be written {where} {d}, where the input's weights (or its run's "
                             f"checkpoints and best/) are kept; choose an output directory outside it")
    if not Path(out).exists():
        return
    if not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass --overwrite")
    names = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else None
    if names is None or (names and not previous(Path(out))):
        held = "is a file" if names is None else "holds " + ", ".join(names[:4]) + (
            f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"{out} is not an earlier {what} ({held}); --overwrite replaces only such an output: "
                         f"choose another output directory (or move that one away)")


def _weights_dirs(source: str) -> tuple[list[Path], list[Path]]:
    """(what to-hf's output must not be or hold, what it must not lie inside) for weights read from ``source``:
    the source and, when it is a run directory or one of its checkpoints or best/, the run directory and its
    checkpoints/ and best/. Elsewhere in a run directory the export may go (README: to-hf runs/x runs/x/hf)."""
    p = Path(source).resolve()
    runs = [r for r in (p, p.parent, p.parent.parent)
            if checkpoints_dir(r).is_dir() and (p == r or p == r / "best" or checkpoints_dir(r) in [p, *p.parents])]
    if not runs:
        return [p], [p]
    run = runs[0]
    return [run, p], [d for d in (p, checkpoints_dir(run), run / "best") if d != run]


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
    their run, if known, trained it) and the projection head are written only when the weights have them.
    ``out_dir`` is checked first (``check_out_dir``): never the weights, their run or a directory --overwrite must
    not replace."""
    replaced, read = _weights_dirs(checkpoint)
    check_out_dir(out_dir, inputs=replaced, keep_out_of=read, overwrite=overwrite, previous=is_hf_export,
                  what="export of pretrain-convert to-hf")
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
    the weights it has (no fresh heads), the model.* settings it states, its max_seq_length as data.max_len.
    ``out`` is never ``hf_dir``, around it or inside it, and ``overwrite`` replaces only an earlier from-hf output."""
    import tempfile

    check_out_dir(out, inputs=[Path(hf_dir)], keep_out_of=[Path(hf_dir)], overwrite=overwrite,
                  previous=is_init_export, what="output of pretrain-convert from-hf")
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR when it is an earlier export of to-hf (never the run or anything else)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read an old checkpoint of ours that has no model.safetensors by unpickling its DeepSpeed "
                        "files (runs any code they carry: only for checkpoints you trust)")
    p = sub.add_parser("from-hf",
                       help="HF BERT/RoBERTa/ModernBERT directory -> init directory for checkpoint.init_from")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it is an earlier output of from-hf (never anything else)")
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
