"""Thin CLI: raw text → sharded binary dataset, or --verify DIR (see pretrain.prep.preprocess.main)."""

import sys

from pretrain.prep.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
