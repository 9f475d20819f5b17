"""Evaluate a sentence encoder: STS12–16, STS-B, SICK-R, SentEval transfer, alignment/uniformity, ranking.

Thin wrapper over `pretrain.eval.cli` (also installed as `pretrain-eval`):

    python tools/eval.py --model runs/x --suites all --out runs/x/eval
"""

from pretrain.eval.cli import main

if __name__ == "__main__":
    main()
