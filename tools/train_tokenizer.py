"""Thin CLI: train a WordPiece/BPE/unigram tokenizer (see pretrain.prep.tokenizer.main)."""

import sys

from pretrain.prep.tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
