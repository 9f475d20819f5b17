"""Fine-tune on GLUE (8 tasks, official metrics) over an lr × seed grid; CLEAR Table 1 style summary.

Thin wrapper over `pretrain.eval.glue_cli` (also installed as `pretrain-finetune-glue`):

    python tools/finetune_glue.py --model runs/x/hf --tasks rte,mrpc,cola,stsb --lrs 1e-5,2e-5,3e-5 \
        --seeds 1,2,3 --out runs/x/glue
"""

from pretrain.eval.glue_cli import main

if __name__ == "__main__":
    main()
