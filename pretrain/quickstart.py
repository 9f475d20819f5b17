"""Quickstart: embedded corpus -> tokenizer -> sharded dataset -> a tiny MLM + CLEAR run.

    python -m pretrain.quickstart [RUN_DIR] [key=value ...]
    python -m pretrain.quickstart RUN_DIR --prepare-only   (data only, and RUN_DIR/data.yaml naming it: add
                                                             include=RUN_DIR/data.yaml to configs/quickstart.yaml)

Everything it needs ships with Python and this package (see ``pretrain.prep.embedded``);
steps already done in RUN_DIR are reused.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pretrain.prep.embedded import write_embedded_corpus
from pretrain.prep.preprocess import preprocess
from pretrain.prep.tokenizer import train_tokenizer
from pretrain.train import main as train_main

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def prepare(run_dir: Path, *, vocab_size: int = 8192, num_workers: int = 2) -> dict:
    """Corpus, tokenizer and datasets under run_dir; returns their paths."""
    corpus = run_dir / "corpus"
    train_txt, valid_txt = corpus / "train.txt", corpus / "valid.txt"
    if not (train_txt.is_file() and valid_txt.is_file()):
        train_txt, valid_txt = write_embedded_corpus(corpus, valid_every=10)
    tok = run_dir / "tokenizer" / "tokenizer.json"
    if not tok.is_file():
        t0 = time.perf_counter()
        train_tokenizer([str(train_txt)], str(tok), kind="wordpiece", vocab_size=vocab_size)
        print(f"[quickstart] tokenizer trained in {time.perf_counter() - t0:.1f}s -> {tok}", flush=True)
    paths = {"tokenizer": tok}
    for split, txt in (("train", train_txt), ("valid", valid_txt)):
        out = run_dir / "data" / split
        if not (out / "manifest.json").is_file():
            preprocess([str(txt)], str(out), str(tok), num_workers=num_workers)
        paths[split] = out
    return paths


def write_data_yaml(run_dir: Path, paths: dict) -> Path:
    """RUN_DIR/data.yaml: the data keys of the prepared corpus, for ``include=RUN_DIR/data.yaml`` (e.g. under
    Slurm, where the quickstart's own launcher does not run)."""
    import yaml

    data = {"tokenizer": str(paths["tokenizer"]),
            "sources": [{"name": "python_docs", "path": str(paths["train"])}],
            "valid": [{"name": "python_docs", "path": str(paths["valid"])}]}
    out = run_dir / "data.yaml"
    out.write_text("# written by python -m pretrain.quickstart --prepare-only\n"
                   + yaml.safe_dump({"data": data}, sort_keys=False), encoding="utf-8")
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    unknown = [a for a in argv if a.startswith("-") and a not in ("--prepare-only", "--verbose")]
    if unknown:  # a run directory named "--verbose" is never what was meant
        print(f"quickstart: unknown option {unknown[0]}; usage:\n{__doc__.strip()}", file=sys.stderr)
        return 2
    prepare_only = "--prepare-only" in argv
    argv = [a for a in argv if a != "--prepare-only"]
    run_dir = Path(argv.pop(0) if argv and "=" not in argv[0] and not argv[0].startswith("-") else "runs/quickstart")
    t0 = time.perf_counter()
    paths = prepare(run_dir)
    if prepare_only:
        data_yaml = write_data_yaml(run_dir, paths)
        print(f"[quickstart] data ready in {run_dir}; train with: pretrain-train configs/quickstart.yaml "
              f"include={data_yaml} run_dir={run_dir}")
        return 0
    overrides = [
        f"run_dir={run_dir}",
        f"data.tokenizer={paths['tokenizer']}",
        f"data.sources=[{{name: python_docs, path: {paths['train']}}}]",
        f"data.valid=[{{name: python_docs, path: {paths['valid']}}}]",
    ] + argv

    code = train_main([str(DEFAULT_CONFIG)] + overrides)
    if code != 0:
        return code
    valid = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"split": "valid"' in line]
    minutes = (time.perf_counter() - t0) / 60
    print(f"\n[quickstart] finished in {minutes:.1f} min")
    if len(valid) >= 2 and "mlm" in valid[0]:
        first, last = valid[0]["mlm"], valid[-1]["mlm"]
        print(f"[quickstart] held-out MLM loss {first:.3f} (step {valid[0]['step']}) -> {last:.3f} "
              f"(step {valid[-1]['step']}): -{first - last:.3f} ({100 * (first - last) / first:.0f}%)")
    print(f"[quickstart] artifacts in {run_dir}/: config.yaml, metrics.jsonl, tb/, checkpoints/, tokenizer/, data/")
    print("[quickstart] next:")
    print(f"  tensorboard --logdir {run_dir}/tb")
    print(f"  pretrain-convert to-hf {run_dir} {run_dir}/hf")
    print(f"  pretrain-eval --model {run_dir} --suites sts --out {run_dir}/eval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
