"""`pretrain-eval`: STS (7 tasks, both conventions), SentEval transfer, alignment/uniformity, ranking.

    pretrain-eval --model runs/x --data-dir ../shared/data --out runs/x/eval   (pooling: the run's; --pooling)
Writes <out>/eval.json (everything) and <out>/eval.md (tables in the papers' layouts); an --out holding earlier
results is refused before the model is read, unless --overwrite.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pretrain.checkpoint.files import atomic_write_text, strict_json
from pretrain.checkpoint.store import CheckpointError
from pretrain.console import set_verbose
from pretrain.eval import RESULT_FILES, check_out, fail, find_data_dir, sts
from pretrain.eval.alignment_uniformity import stsb_alignment_uniformity
from pretrain.eval.encoder import load_sentence_encoder
from pretrain.eval.ranking import ranking_markdown_table, ranking_metrics
from pretrain.eval.senteval import evaluate_transfer, transfer_markdown_table
from pretrain.eval.transfer_setup import TRANSFER_CLASSIFIERS, ClassifierConfig, transfer_classifier
from pretrain.export.recorded import EVAL_POOLINGS, recorded_matryoshka_dims, recorded_pooling
from pretrain.export.resolve import select_checkpoint

SUITES = ("sts", "transfer", "align", "ranking")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain-eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="our checkpoint, a pretrain-convert dir, or a HF BERT dir")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|step_N",
                   help="with a run directory as --model: its newest checkpoint (default), best/ (best STS-B dev, "
                        "from eval.stsb_every) or checkpoints/step_N")
    p.add_argument("--pooling", default="auto", choices=["auto", *EVAL_POOLINGS],
                   help="the sentence embedding; auto (default): the one the model was evaluated with in training "
                        "(a checkpoint's eval.pooling, else model.pooling, else SARCSE's Z), a sentence-transformers "
                        "model's Pooling module, or cls_before_pooler for a HF BERT directory (SimCSE's); "
                        "autoencoder_z: SARCSE's Z (its inference embedding), from the autoencoder a SARCSE run's "
                        "checkpoints and best/ keep")
    p.add_argument("--backend", default="auto", choices=["auto", "pretrain", "transformers"])
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read an old checkpoint of ours that has no model.safetensors by unpickling its DeepSpeed "
                        "files (runs any code they carry: only for checkpoints you trust)")
    p.add_argument("--data-dir", default="",
                   help="STS/SentEval data root (default: $PRETRAIN_DATA_DIR, else ../shared/data from here, then "
                        "beside the repository)")
    p.add_argument("--suites", default="sts,align,ranking", help=f"comma list of {SUITES} or 'all'")
    p.add_argument("--sts-tasks", default=",".join(sts.TASKS))
    p.add_argument("--dims", default="auto", metavar="auto|D1,D2,...|none",
                   help="STS also at these truncated embedding sizes (the first D coordinates, as "
                        "sentence-transformers' truncate_dim); auto = the Matryoshka sizes the model records")
    p.add_argument("--transfer-tasks", default="MR,CR,SUBJ,MPQA,SST2,TREC,MRPC")
    p.add_argument("--variant", default="senteval", choices=list(sts.VARIANTS),
                   help="STS copy: SentEval's tokenized one (papers) or the untokenized originals")
    p.add_argument("--transfer-classifier", default="sklearn", choices=list(TRANSFER_CLASSIFIERS),
                   help="transfer: sklearn = SentEval's scikit-learn logistic regression (usepytorch=False, C grids, "
                        "10 folds), the default here; pytorch-test = SentEval's PyTorch path "
                        "as SimCSE's evaluation.py mode 'test' runs it (Adam, batch 64, tenacity 5, epoch_size 4, "
                        "L2 1e-5..1e-2, 10 folds), what the SimCSE, ArcCSE and RankCSE transfer tables used, many "
                        "times slower on CPU (CR: ~6 min on 2 cores); pytorch-fasttest = its mode 'fasttest' "
                        "(RMSprop, batch 32, tenacity 3, epoch_size 2, 5 folds)")
    p.add_argument("--inner-kfold", type=int, default=None,
                   help="transfer: the folds that choose the classifier's regularisation: the inner folds of MR, "
                        "CR, SUBJ, MPQA and the cross-validation on train of TREC and MRPC (default: the "
                        "classifier's folds, as SentEval)")
    p.add_argument("--jobs", type=int, default=0,
                   help="transfer: processes for the classifier fits (0 = every core); results do not depend on it")
    p.add_argument("--mrpc-features", default="senteval", choices=["senteval", "uv_absdiff_prod"],
                   help="transfer MRPC features: senteval = [|u-v|, u*v] (SentEval's, what papers report); "
                        "uv_absdiff_prod = [u, v, |u-v|, u*v]")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sentence, [CLS] and [SEP] included (default: 128, or the model's position "
                        "embeddings where they hold fewer)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave)")
    p.add_argument("--name", default=None, help="row label in the tables (default: model path)")
    p.add_argument("--out", default=None, help="output directory (default: print only)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the eval.json and eval.md an earlier evaluation left in --out (else refused)")
    p.add_argument("--no-progress", action="store_true", help="no encode bar (there is none off a terminal)")
    p.add_argument("--verbose", action="store_true",
                   help="let transformers' and scikit-learn's messages (ConvergenceWarning) through")
    return p


def run_eval(encode_fn, data_dir, suites, *, sts_tasks=sts.TASKS, transfer_tasks=None, variant="senteval",
             classifier_cfg=None, log=print, transfer_results=None, resume_key=None, dims=()) -> dict:
    """All requested suites for one encode_fn -> results dict (JSON-serialisable). ``transfer_results``: a JSON
    file each finished transfer task is written to, and resumed from (for the same ``resume_key``). ``dims``: STS
    also on the embeddings truncated to each size (``sts_dims``: {d: STS results})."""
    res: dict = {"variant": variant}
    timings = {}
    if "sts" in suites or "ranking" in suites:
        t0 = time.time()
        sts_res, sims = sts.evaluate_sts(encode_fn, data_dir, sts_tasks, variant, return_sims=True)
        timings["sts"] = time.time() - t0
        if "sts" in suites:
            res["sts"] = sts_res
            for t in sts_tasks:
                log(f"[sts] {t}: all {sts_res[t]['spearman']['all']:.2f} mean {sts_res[t]['spearman']['mean']:.2f} "
                    f"wmean {sts_res[t]['spearman']['wmean']:.2f}")
        if "ranking" in suites:
            res["ranking"] = {t: ranking_metrics(task, s) for t, (task, s) in sims.items()}
    if "sts" in suites and dims:
        t0 = time.time()
        res["sts_dims"] = sts_at_sizes(encode_fn, data_dir, sts_tasks, variant, dims, log=log)
        timings["sts_dims"] = time.time() - t0
    if "align" in suites:

        res["align_uniform"] = stsb_alignment_uniformity(encode_fn, data_dir, variant)
        log(f"[align] {res['align_uniform']}")
    if "transfer" in suites:

        t0 = time.time()
        classifier_cfg = classifier_cfg or ClassifierConfig()
        res["transfer"] = evaluate_transfer(encode_fn, data_dir, transfer_tasks, classifier_cfg, log=log,
                                            results_path=transfer_results, resume_key=resume_key)
        res["transfer_classifier"] = {"description": classifier_cfg.describe(), **classifier_cfg.settings()}
        timings["transfer"] = time.time() - t0
    res["timings_s"] = timings
    return res


def sts_at_sizes(encode_fn, data_dir, sts_tasks, variant: str, dims, *, log=print) -> dict:
    """{d: STS results} of the embeddings cut to their first d coordinates (each sentence encoded once)."""
    memo: dict = {}

    def full(sentences):
        key = tuple(sentences)
        if key not in memo:
            memo[key] = encode_fn(sentences)
        return memo[key]

    out = {}
    for d in dims:
        out[int(d)] = sts.evaluate_sts(lambda sentences, d=d: truncate(full(sentences), d), data_dir, sts_tasks,
                                       variant)
        log(f"[sts@{d}] " + " ".join(f"{t} {out[int(d)][t]['spearman']['all']:.2f}" for t in sts_tasks))
    return out


def truncate(emb, dim: int):
    """The first ``dim`` coordinates of each embedding (numpy or torch; cosine re-normalises)."""
    if dim > emb.shape[-1]:
        raise ValueError(f"--dims {dim} is larger than the embedding ({emb.shape[-1]} dimensions)")
    return emb[..., :dim]


def sts_dims_markdown(res: dict) -> str:
    """One row per size: STS 'all' Spearman x100 per task and their average."""
    by_dim = res["sts_dims"]
    tasks = list(next(iter(by_dim.values())))
    rows = ["| dims | " + " | ".join(tasks) + " | avg |", "|---|" + "---|" * (len(tasks) + 1)]
    for d, r in sorted(by_dim.items(), key=lambda x: -int(x[0])):
        vals = [r[t]["spearman"]["all"] for t in tasks]
        rows.append(f"| {d} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    return "\n".join(rows)


def markdown_report(name: str, res: dict) -> str:
    parts = []
    if "sts" in res:
        parts += [f"### STS (Spearman ×100, cosine; {res['variant']} copy)", "",
                  sts.sts_markdown_table({name: res["sts"]}),
                  "all = subsets concatenated (SimCSE); mean / wmean = SentEval's per-subset mean / "
                  "size-weighted mean. STS-B and SICK-R: test sets.", ""]
    if res.get("sts_dims"):
        parts += ["### STS at truncated embedding sizes (Spearman ×100, 'all')", "", sts_dims_markdown(res), ""]
    if "transfer" in res:
        parts += ["### SentEval transfer (accuracy)", "", transfer_markdown_table({name: res["transfer"]})]
        if "transfer_classifier" in res:
            parts += [f"Classifier: {res['transfer_classifier']['description']}.", ""]
    if "align_uniform" in res:
        au = res["align_uniform"]
        parts += ["### Alignment / uniformity (STS-B dev)", "", "| Model | align | uniform |", "|---|---|---|",
                  f"| {name} | {au['align']:.4f} | {au['uniform']:.4f} |", ""]
    if "ranking" in res:
        parts += ["### Ranking (RankCSE appendix G)", "", ranking_markdown_table({name: res["ranking"]})]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    set_verbose(args.verbose)
    try:  # before anything slow: not a traceback, or earlier results replaced, once the evaluation is done
        check_out(args.out, RESULT_FILES, overwrite=args.overwrite)
    except ValueError as e:
        fail("pretrain-eval", e)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    suites = _suites_and_data(args)
    try:
        model_path, reading = select_checkpoint(args.model, args.checkpoint)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        fail("pretrain-eval", e)
    print(reading, flush=True)
    try:
        pooling, why = recorded_pooling(model_path) if args.pooling == "auto" else (args.pooling, "--pooling")
        enc = load_sentence_encoder(model_path, pooling, backend=args.backend, max_len=args.max_len,
                                    batch_size=args.batch_size, device=args.device, progress=not args.no_progress,
                                    trust=args.trust_checkpoint)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        fail("pretrain-eval", e)
    args.pooling, args.max_len = enc.pooling, enc.max_len  # what the results, resume key and eval.json record
    print(f"pooling: {enc.pooling} ({why}); sentences cut at {enc.max_len} tokens", flush=True)
    try:
        dims = _dims(args.dims, model_path)
    except ValueError as e:
        fail("pretrain-eval", e)
    try:
        cfg = transfer_classifier(args.transfer_classifier, inner_kfold=args.inner_kfold,
                                  mrpc_features=args.mrpc_features, n_jobs=args.jobs)
    except ValueError as e:
        fail("pretrain-eval", e)
    # With --out, each finished transfer task is kept in OUT/transfer_partial.json: a rerun of the same command
    # (same model, pooling, length and classifier settings: evaluate_transfer adds cfg.settings() to this key)
    # continues after the last finished task.
    partial = Path(args.out) / "transfer_partial.json" if args.out else None
    key = transfer_key(model_path, args)
    try:
        res = run_eval(enc, args.data_dir, suites, sts_tasks=[t for t in args.sts_tasks.split(",") if t],
                       transfer_tasks=[t for t in args.transfer_tasks.split(",") if t], variant=args.variant,
                       classifier_cfg=cfg, transfer_results=partial, resume_key=key, dims=dims)
    except FileNotFoundError as e:
        fail("pretrain-eval", f"{e} (data root {args.data_dir}: pass --data-dir or set PRETRAIN_DATA_DIR to the "
                              f"directory holding sts/ and senteval/)")
    except ValueError as e:  # a data file in another format (the readers name it and the line)
        fail("pretrain-eval", e)
    res["args"] = vars(args)
    res["checkpoint"] = {"path": str(model_path), "line": reading}
    name = args.name or str(args.model)
    report = markdown_report(name, res)
    print(report)
    if args.out:
        write_outputs(Path(args.out), res, report)


def transfer_key(model_path, args) -> dict:
    """What a rerun's finished transfer tasks must share to be taken from ``transfer_partial.json``: the model (its
    path and its files' sizes and modification times, so a directory exported again is not taken for the old
    one), pooling, backend, length and the data directory."""
    model = Path(model_path).resolve()
    files = sorted(f for f in model.iterdir() if f.is_file()) if model.is_dir() else [model]
    return {"model": str(model), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "pooling": args.pooling, "backend": args.backend, "max_len": args.max_len,
            "data": str(Path(args.data_dir).resolve())}


def write_outputs(out: Path, res: dict, report: str) -> None:
    """<out>/eval.json as strict JSON (an undefined correlation, e.g. KCC with no ranking sample, is null, not
    NaN) and <out>/eval.md, each written whole (a reader never sees a partial file)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "eval.json", strict_json(res))
    atomic_write_text(out / "eval.md", report)


def _suites_and_data(args) -> tuple:
    """The suites --suites names (an unknown one ends the command) and ``args.data_dir`` found for them."""
    suites = SUITES if args.suites == "all" else tuple(s.strip() for s in args.suites.split(","))
    for s in suites:
        if s not in SUITES:
            fail("pretrain-eval", f"unknown suite {s!r}; choose from {SUITES} or 'all'")
    need = "sts" if {"sts", "align", "ranking"} & set(suites) else "senteval" if "transfer" in suites else ""
    try:
        args.data_dir = find_data_dir(args.data_dir, need=need, what=f"{need or 'shared'} data for --suites",
                                      flag="--data-dir")
    except FileNotFoundError as e:
        fail("pretrain-eval", e)
    return suites


def _dims(arg: str, model_path) -> list[int]:
    """--dims: auto (the model's recorded Matryoshka sizes), none, or a comma list of sizes."""
    if arg == "auto":
        return recorded_matryoshka_dims(model_path)
    if arg in ("", "none"):
        return []
    try:
        dims = [int(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--dims {arg!r}: give auto, none or sizes like 256,64") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"--dims {arg!r}: sizes must be >= 1")
    return dims


if __name__ == "__main__":
    main()
