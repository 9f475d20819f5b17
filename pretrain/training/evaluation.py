"""Evaluation during training: STS-B dev Spearman every N steps, best weights kept.

The best weights go to ``<run_dir>/best/`` in the weights-directory format of
``pretrain-convert from-hf`` (model.safetensors, config.yaml, tokenizer.json) plus best.json and
run_config.yaml, all written to a temporary directory and swapped in whole (a reader sees the old best/ or
the new one, never neither and never a best.json of another version), so ``pretrain-eval``, ``pretrain-convert
to-hf`` and ``checkpoint.init_from`` all take it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from pretrain.config.train import EvalConfig, evaluation_pooling
from pretrain.eval import find_data_dir
from pretrain.eval.encoder import SentenceEncoder
from pretrain.export.hf import write_init_dir
from pretrain.fsutil import recover_dir
from pretrain.metrics.writer import print_progress
from pretrain.model import PretrainModel, build_model
from pretrain.model.autoencoder import AUTOENCODER_Z, ZEmbedding


def stsb_data_dir(cfg: EvalConfig, zero_stage: int) -> str:
    """The STS data root eval.stsb_every will read: eval.data_dir, else $PRETRAIN_DATA_DIR, else ../shared/data
    (``pretrain.eval.find_data_dir``, the rule every tool follows); FileNotFoundError naming where it looked,
    ValueError when ZeRO-3 makes it impossible. Config-only and import-free: the trainer runs it first."""

    if zero_stage == 3:
        raise ValueError("eval.stsb_every needs whole parameters on each rank; use distributed.zero_stage <= 2 "
                         "for sentence-stage training (the models are small) or evaluate checkpoints offline")
    return find_data_dir(cfg.data_dir, need="sts/STSBenchmark", what="eval.stsb_every: STS-B dev",
                         flag="eval.data_dir=DIR")


class StsbKeepBest:
    def __init__(self, cfg: EvalConfig, *, run_dir: Path, tokenizer, tokenizer_path: str, model_pooling: str,
                 zero_stage: int, is_main: bool, autoencoder: bool = False):
        # Imported here, not at the top: it brings scipy.stats, ~2 s of start-up on every rank (measured with
        # python -X importtime) that only runs with eval.stsb_every.
        from pretrain.eval.sts import StsbDevEvaluator

        data_dir = stsb_data_dir(cfg, zero_stage)
        self.cfg, self.run_dir = cfg, run_dir
        self.tokenizer, self.tokenizer_path = tokenizer, tokenizer_path
        # SARCSE (an autoencoder among the heads): its Z is the embedding it trains and infers with (Sec. 2.2)
        self.pooling = evaluation_pooling(cfg.pooling, model_pooling, autoencoder)
        if self.pooling == AUTOENCODER_Z and not autoencoder:
            raise ValueError(f"eval.pooling={AUTOENCODER_Z} needs SARCSE's autoencoder (objective.reconstruction); "
                             f"this run has none: leave eval.pooling empty or name a pooling")
        self.evaluator = StsbDevEvaluator(data_dir)
        self.best = float("-inf")
        if is_main:  # a swap of best/ cut by a kill: its old copy back in place, leftovers removed
            recover_dir(run_dir / "best")
        self.best = stored_best(run_dir / "best" / "best.json", self.pooling, say=print_progress if is_main else None)

    @torch.no_grad()
    def __call__(self, model, *, step: int, config_yaml: str, is_main: bool, heads=None) -> dict:
        """``heads``: the objective's trainable heads (the autoencoder for ``AUTOENCODER_Z``; kept in best/)."""
        # In fp32 whatever the training precision: best/ keeps these weights, and pretrain-eval computes them in
        # fp32; a bf16 forward scored (and chose) best/ by other embeddings than any later evaluation of it.
        evaluated = _in_fp32(model)
        embedder = ZEmbedding(evaluated, _in_fp32(heads["autoencoder"])) if self.pooling == AUTOENCODER_Z else evaluated
        encode = SentenceEncoder(embedder, self.tokenizer, pooling=self.pooling, max_len=self.cfg.max_len,
                                 device=str(next(model.parameters()).device))
        score = self.evaluator(encode)
        improved = score > self.best
        if improved:
            self.best = score
            if self.cfg.keep_best and is_main:
                self._write_best(model, step, score, config_yaml, heads)
        return {"stsb_dev_spearman": score, "stsb_dev_best": self.best}

    def _write_best(self, model, step: int, score: float, config_yaml: str, heads=None) -> None:
        """best/ with its best.json and run_config.yaml as one version, swapped in whole (``write_init_dir``)."""
        best_json = json.dumps({"step": step, "stsb_dev_spearman": score, "pooling": self.pooling}, indent=2)
        head_state = {f"heads.{k}": v for k, v in heads.state_dict().items()} if heads is not None else None
        write_init_dir(model, self.tokenizer_path, str(self.run_dir / "best"), overwrite=True,
                       extra_files={"run_config.yaml": config_yaml, "best.json": best_json}, heads=head_state)


def _in_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` when its floating-point weights are all fp32, else an fp32 copy of it for one evaluation (the
    sentence stage keeps whole parameters on each rank: ZeRO <= 2, ``stsb_data_dir``)."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        return module
    if isinstance(module, PretrainModel):  # built anew: its layers may be flat (train.flat_params), views deepcopy
        twin = build_model(module.cfg, init=False)  # refuses; the state dict names each tensor as built
        twin.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in module.state_dict().items()})
        return twin.to(tensors[0].device).train(module.training)
    memo = {}  # each tensor copied by hand into deepcopy's memo, in fp32
    for t in tensors:
        data = t.detach().float() if t.is_floating_point() else t.detach().clone()
        memo[id(t)] = torch.nn.Parameter(data, requires_grad=False) if isinstance(t, torch.nn.Parameter) else data
    return copy.deepcopy(module, memo)


def stored_best(best_json: Path, pooling: str, *, say=None) -> float:
    """The STS-B dev score a resumed run keeps comparing against: best/best.json's, when it is readable and was
    selected by the same pooling; else -inf (the next evaluation writes best/ anew), saying why. A damaged best.json
    stopped the resume with a traceback; one of another pooling (a recipe that now selects by SARCSE's Z, not
    [CLS]) would have compared scores of two embeddings."""
    say = say or (lambda _: None)
    if not best_json.is_file():
        return float("-inf")
    try:
        saved = json.loads(best_json.read_text(encoding="utf-8"))
        score = float(saved["stsb_dev_spearman"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        say(f"warning: {best_json} is unreadable ({type(e).__name__}); the next STS-B evaluation replaces best/")
        return float("-inf")
    if saved.get("pooling", pooling) != pooling:
        say(f"warning: {best_json.parent} was selected by pooling {saved['pooling']} (STS-B dev {score:.4f}); this "
            f"run selects by {pooling}: the next evaluation replaces it")
        return float("-inf")
    return score
