"""Thin CLI: see pretrain.export.convert (also installed as `pretrain-convert`)."""

import sys

from pretrain.export.convert import main

if __name__ == "__main__":
    sys.exit(main())
