"""Thin CLI: train a WordPiece/BPE/unigram tokenizer (see pretrain.data.tokenizer.main)."""

import sys

from pretrain.data.tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
