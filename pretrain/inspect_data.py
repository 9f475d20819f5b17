"""``pretrain-inspect``: the first training samples of a config, as text.

    pretrain-inspect configs/recipes/clear_del_span_reorder.yaml -n 4 [key=value ...] [--start P]

Prints, for global positions P .. P+N-1 of the training stream (the order every rank and worker count shares;
``--start`` = a run's ``consumed_samples`` shows what it draws next), the sample's key ``(epoch, index)``,
the MLM input with its [MASK]s and random replacements, the labels it predicts, and both views after the
configured augmentation. They are the same arrays training builds for those keys.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pretrain.checkpoint import store
from pretrain.config import load_run_config
from pretrain.data.loader import ORDER_RULE, SampleOrder
from pretrain.prep.tokenizer import load_tokenizer
from pretrain.training.build import build_train_set


def inspect_samples(cfg, n: int, start: int = 0) -> tuple[object, list[tuple[tuple[int, int], dict]]]:
    """(tokenizer, [(key, sample)]) for global stream positions start .. start + n - 1 of ``cfg``'s training set."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    dataset = build_train_set(cfg, tokenizer)
    keys = SampleOrder(len(dataset), seed=cfg.seed, rule=order_rule(cfg)).keys(start, n)
    return tokenizer, [(key, dataset[key]) for key in keys]


def order_rule(cfg) -> str:
    """The sample order rule the config's run continues with: its latest checkpoint's (``permutation-v1`` for
    checkpoints from before rules were recorded), else the rule new runs use."""
    state = store.latest_trainer_state(cfg.run_dir) if cfg.run_dir else None
    return state["sample_order"] if state is not None else ORDER_RULE


def _tokens(tokenizer, ids) -> str:
    """Token strings joined by spaces (sub-word pieces kept apart, specials shown)."""
    return " ".join(tokenizer.id_to_token(int(i)) if 0 <= int(i) < tokenizer.vocab_size else f"<{int(i)}>"
                    for i in ids)


def format_sample(tokenizer, key: tuple[int, int], sample: dict) -> str:
    lines = [f"sample (epoch {key[0]}, index {key[1]})" + (f", source {sample['source']}" if "source" in sample else "")]
    if "input_ids" in sample and "mlm_labels" in sample:
        inp, labels = np.asarray(sample["input_ids"]), np.asarray(sample["mlm_labels"])
        chosen = np.flatnonzero(labels != -100)
        original = np.where(labels != -100, labels, inp)
        lines.append(f"  text       {tokenizer.decode(original, skip_special_tokens=True)}")
        lines.append(f"  mlm input  {_tokens(tokenizer, inp)}")
        lines.append(f"  predicts   {len(chosen)} of {len(inp)} tokens: " + ", ".join(
            f"{p}:{tokenizer.id_to_token(int(labels[p]))}" + ("" if inp[p] == tokenizer.mask_id else
                                                               f" (shown as {tokenizer.id_to_token(int(inp[p]))})")
            for p in chosen.tolist()))
    for name, value in sample.items():
        if name in ("input_ids", "mlm_labels", "source") or not isinstance(value, np.ndarray):
            continue
        lines.append(f"  {name:<10} {_tokens(tokenizer, value)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pretrain-inspect", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="YAML config (see configs/); omitted = defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.augment.methods=del-word")
    p.add_argument("-n", type=int, default=4, help="samples to show (default 4)")
    p.add_argument("--start", type=int, default=0, help="first global stream position (default 0)")
    args = p.parse_intermixed_args(argv)  # options may come between the config and the overrides
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None

    try:
        cfg = load_run_config(args.config, args.overrides)
        tokenizer, samples = inspect_samples(cfg, args.n, args.start)
    except (ValueError, FileNotFoundError, store.CheckpointError) as e:
        print(f"pretrain-inspect: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(samples)} training samples from stream position {args.start} (seed {cfg.seed}, "
          f"augment {cfg.data.augment.methods}, max_len {cfg.data.max_len}, view_max_len {cfg.data.view_max_len})")
    for key, sample in samples:
        print(format_sample(tokenizer, key, sample))
    return 0


if __name__ == "__main__":
    sys.exit(main())
