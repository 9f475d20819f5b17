"""Thin CLI: see pretrain.checkpoint.convert (also installed as `pretrain-convert`)."""

import sys

from pretrain.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
