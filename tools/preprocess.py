"""Thin CLI: raw text → sharded binary dataset, or --verify DIR (see pretrain.data.preprocess.main)."""

import sys

from pretrain.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
