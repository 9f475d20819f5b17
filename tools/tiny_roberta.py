"""A tiny RoBERTa stand-in for roberta-base, made here without a download (issue 29 items 1-2: SARCSE's recipe).

No RoBERTa checkpoint is on this machine, so the SARCSE recipe (``configs/recipes/sarcse_roberta_base.yaml``) runs
from a transformers ``RobertaForMaskedLM`` that transformers itself initialises at random, at ``model=tiny``'s
sizes (128 hidden, 2 layers, 2 heads, FFN 512, 514 position rows with pad 1, one token type, no pooler as in
roberta-base's published weights), with a byte-level BPE tokenizer like RoBERTa's (its five special tokens at ids
0-4 and its ``<s> A </s>`` post-processor) trained on the given text. The directory is what a user would hand to
``pretrain-convert from-hf``; with ``--init`` that conversion is run too.

    python tools/tiny_roberta.py TEXT [TEXT ...] OUT [--vocab-size 8000] [--init]
        -> OUT/hf (transformers directory), and with --init OUT/init (pretrain-convert from-hf OUT/hf OUT/init)

Its weights are random: figures from it say how fast and whether the recipe's term leaves chance, not what SARCSE
reaches from a pretrained RoBERTa. The test suite builds the same stand-in (tests/conftest.py's ``tiny_roberta``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
"""RoBERTa's special tokens, ids 0..4 as in roberta-base (pad 1: positions start at 2)."""


def train_roberta_tokenizer(lines, out: Path, vocab_size: int = 600) -> Path:
    """A byte-level BPE tokenizer.json like RoBERTa's (its special tokens and post-processor) trained on ``lines``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(ROBERTA_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(out))
    return out


def save_roberta_dir(hf, tokenizer_json: Path, out: Path) -> Path:
    """A transformers RoBERTa model directory: ``hf.save_pretrained`` + its tokenizer files (no downloads)."""
    from transformers import PreTrainedTokenizerFast

    hf.save_pretrained(str(out))
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token="<s>", eos_token="</s>", cls_token="<s>",
                            sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                            model_max_length=hf.config.max_position_embeddings - 2).save_pretrained(str(out))
    return out


def tiny_roberta(lines, out: Path, vocab_size: int, max_position: int = 514, seed: int = 0) -> Path:
    """A random ``RobertaForMaskedLM`` at model=tiny's sizes and its BPE tokenizer, saved in ``out``."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = train_roberta_tokenizer(lines, out.parent / f"{out.name}-bpe.json", vocab_size=vocab_size)
    torch.manual_seed(seed)
    config = transformers.RobertaConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=512,
                                        max_position_embeddings=max_position, type_vocab_size=1, layer_norm_eps=1e-5,
                                        pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return save_roberta_dir(transformers.RobertaForMaskedLM(config).eval(), tok, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", nargs="+", type=Path, help="text files to train the BPE tokenizer on (one or more lines)")
    p.add_argument("out", type=Path)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--init", action="store_true", help="also run pretrain-convert from-hf OUT/hf OUT/init")
    args = p.parse_args(argv)
    missing = [str(t) for t in args.text if not t.is_file()]
    if missing:
        p.error(f"no such text file: {', '.join(missing)}")
    lines = [ln for t in args.text for ln in t.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    hf = tiny_roberta(lines, args.out / "hf", args.vocab_size)
    print(f"tiny RoBERTa (random weights, vocab {args.vocab_size}, {len(lines):,} lines of tokenizer text) -> {hf}")
    if args.init:
        from pretrain.export.convert import main as convert

        code = convert(["from-hf", str(hf), str(args.out / "init")])
        if code:
            return code
        print(f"init directory (checkpoint.init_from=) -> {args.out / 'init'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
