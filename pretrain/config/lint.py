"""Settings that cannot act in a given config: each gets one warning line saying what is ignored and why.

A value is reported only when it differs from its default (the user asked for it) or when it is a switch whose
effect depends on another setting (``train.eval_every`` without ``data.valid``). The trainer prints these once
at start (rank 0), and so does ``pretrain-train --dry-run``.
"""

from __future__ import annotations

import dataclasses

from pretrain.config.data import AugmentConfig, MaskingConfig
from pretrain.config.model import ModelConfig
from pretrain.config.objective import RankDistillConfig
from pretrain.config.train import EvalConfig, TrainConfig, evaluation_pooling

_ARCH_ONLY = {"bert": (("norm", "type_vocab_size"), "modernbert is always pre-norm and has no token types"),
              "modernbert": (("local_window", "global_every", "rope_theta", "rope_theta_local"),
                             "they shape its rotary positions and local attention")}
"""The model.* settings only one model.arch reads, and why."""

_AUGMENT_OPTIONS = {"del-word": ("del_word_rate",), "del-span": ("del_span_num", "del_span_frac"),
                    "reorder": ("reorder_pairs", "reorder_frac"), "subs": ("subs_rate", "wordnet_dir")}
"""The data.augment options each augmentation reads."""


def _changed(obj, default, names) -> list[str]:
    return [n for n in names if getattr(obj, n) != getattr(default, n)]


def _arch_only_lines(model: ModelConfig) -> list[str]:
    """model.* settings of the other architecture that the config changed."""
    out = []
    for arch, (names, why) in _ARCH_ONLY.items():
        unused = _changed(model, ModelConfig(), names) if model.arch != arch else []
        if unused:
            out.append(f"model.{', model.'.join(unused)} do nothing with model.arch={model.arch}: only "
                       f"model.arch={arch} reads them ({why})")
    return out


def _compile_lines(cfg) -> list[str]:
    """train.compile's options without it, and what train.compile leaves out."""
    t = cfg.train
    if not t.compile:
        options = _changed(t, TrainConfig(), ("compile_backend", "compile_mode", "compile_shapes", "compile_bucket"))
        return [f"train.{', train.'.join(options)} do nothing: train.compile=false"] if options else []
    if cfg.objective.gradient_cache:
        return ["train.compile=true compiles nothing under objective.gradient_cache (its passes run eagerly)"]
    lines = []
    if t.unpadded and not t.step_unpadded:
        lines.append(f"train.unpadded=true does nothing with train.compile_shapes={t.compile_shapes}: the compiled "
                     "step runs padded there (unpadded with dynamic or auto shapes); set train.unpadded=false to "
                     "say so")
    if t.compile_mode != "default" and t.compile_backend != "inductor":
        lines.append(f"train.compile_mode={t.compile_mode} does nothing with train.compile_backend={t.compile_backend}"
                     ": only inductor takes a mode (torch drops it with one log line)")
    elif t.compile_mode == "reduce-overhead" and t.compile_shapes != "bucketed":
        lines.append(f"train.compile_mode=reduce-overhead with train.compile_shapes={t.compile_shapes}: CUDA graphs "
                     "record one graph per distinct batch shape, and batches change shape almost every step (width "
                     "and MLM count padded, group sizes unpadded); train.compile_shapes=bucketed pads them to a few "
                     "shapes")
    if t.compile_bucket != TrainConfig().compile_bucket and t.compile_shapes != "bucketed":
        lines.append("train.compile_bucket does nothing without train.compile_shapes=bucketed")
    past_limit = ("torch's recompile limit (8 graphs by default), after which every batch of a shape without a "
                  "graph runs eagerly for the rest of the run; train.compile_shapes=dynamic compiles one graph")
    if t.compile_shapes == "static":
        lines.append("train.compile_shapes=static compiles a graph per batch shape, and real batches change shape "
                     f"almost every step (the longest row, the MLM count): the run soon reaches {past_limit}")
    elif t.compile_shapes == "bucketed" and cfg.objective.triplet is not None:
        lines.append("train.compile_shapes=bucketed with objective.triplet: the number of a batch's rows with a "
                     "triplet (0 to train.micro_batch_size) is a shape the buckets do not pad, so each count is a "
                     f"graph of its own and the run soon reaches {past_limit}")
    return lines


_POOLING_KIND = {"cls": "[CLS]", "cls_before_pooler": "[CLS]", "mean": "mean-pooled"}
"""What each pooling embeds a sentence as ([CLS] with or without BERT's pooler is SimCSE's train/test pair)."""


def _pooling_lines(cfg) -> list[str]:
    """A run whose contrastive terms train one embedding while its evaluation (STS-B dev, best/, pretrain-eval and
    the export) reads another: the recipes' model.pooling=cls with eval.pooling=cls_before_pooler is SimCSE's design,
    model.pooling=mean under it is not (a user who switched to a mean-pooled checkpoint's pooling measured and
    exported [CLS] embeddings nothing trained: STS-B 73.6 against 82.4 with mean pooling)."""
    if not set(CONTRASTIVE_TERMS) & set(cfg.objective.enabled()):
        return []
    model = cfg.model.pooling
    evaluated = evaluation_pooling(cfg.eval.pooling, model, cfg.objective.reconstruction is not None)
    trained, read = _POOLING_KIND.get(model), _POOLING_KIND.get(evaluated)
    if trained is None or read is None or trained == read:
        return []
    return [f"eval.pooling={evaluated} evaluates a {read} embedding (STS-B dev, best/, pretrain-eval and the "
            f"exported model) while the contrastive terms train a {trained} one (model.pooling={model}): set "
            f"eval.pooling={model if model != 'cls' else 'cls_before_pooler'} to evaluate and export what is trained"]


def _joint_lines(cfg) -> list[str]:
    """train.joint_pass=false where the step has no joint pass to turn off (objective/__init__.py: Objective)."""
    t, o = cfg.train, cfg.objective
    if t.joint_pass:
        return []
    enabled = o.enabled()
    why = ("objective.gradient_cache runs its own passes" if o.gradient_cache
           else "data.stage=sentences has no MLM rows and views" if cfg.data.stage == "sentences"
           else "the objective does not have both objective.mlm and a term of the views"
           if "mlm" not in enabled or len(enabled) < 2 else None)
    return [f"train.joint_pass=false does nothing: {why}"] if why else []


CONTRASTIVE_TERMS = ("nt_xent", "info_nce", "arccon", "consistency", "rank_distill")
"""The terms that compare sentences with each other (objective/grad_cache.py: CONTRASTIVE; config/ imports no
objective)."""


def inert_settings(cfg) -> list[str]:
    """One line per setting of ``cfg`` (a RunConfig) that has no effect, with what to do about it."""
    out = []
    d, t = cfg.data, cfg.train
    if t.eval_every and not d.valid:
        out.append(f"train.eval_every={t.eval_every} does nothing: no held-out data is configured (data.valid is "
                   f"empty); add data.valid sources or set train.eval_every=0")
    out += _sentence_stage_lines(cfg) if d.stage == "sentences" else _pretrain_stage_lines(cfg)
    out += _objective_lines(cfg)
    out += _compile_lines(cfg)
    out += _joint_lines(cfg)
    out += _pooling_lines(cfg)
    if t.flat_scope != TrainConfig().flat_scope and (not t.flat_params or cfg.distributed.zero_stage == 3):
        out.append(f"train.flat_scope={t.flat_scope} does nothing: the parameters are per tensor ("
                   f"{'train.flat_params=false' if not t.flat_params else 'ZeRO-3 keeps them so'})")
    if t.unpadded_attention != "auto" and not t.step_unpadded:
        out.append(f"train.unpadded_attention={t.unpadded_attention} does nothing: the step runs padded "
                   f"({f'train.compile_shapes={t.compile_shapes}' if t.unpadded else 'train.unpadded=false'})")
    if not cfg.eval.stsb_every:
        ev = _changed(cfg.eval, EvalConfig(), ("data_dir", "pooling", "max_len", "keep_best"))
        if ev:
            out.append(f"eval.{', eval.'.join(ev)} do nothing: STS-B evaluation is off (eval.stsb_every=0)")
    out += _arch_only_lines(cfg.model)
    if cfg.optim.schedule != "constant" and cfg.optim.warmup_steps >= t.max_steps:
        out.append(f"optim.warmup_steps={cfg.optim.warmup_steps} >= train.max_steps={t.max_steps}: the run ends "
                   f"while the learning rate is still warming up (peak optim.lr={cfg.optim.lr:g} is never reached)")
    return out


def _sentence_stage_lines(cfg) -> list[str]:
    """data.stage=sentences: the pretraining stage's data settings it does not read."""
    d, out = cfg.data, []
    if d.sources:
        used = " (only for SARCSE token frequencies when objective.reconstruction.token_freq is unset)" \
            if cfg.objective.reconstruction is not None else ""
        what = f"data.pairs={d.pairs!r}" if d.pairs else f"data.sentences={d.sentences!r}"
        out.append(f"data.sources is not read by data.stage=sentences, which trains on {what}{used}")
    aug = _changed(d.augment, AugmentConfig(), [f.name for f in dataclasses.fields(AugmentConfig)])
    if aug:
        out.append(f"data.augment.{', data.augment.'.join(aug)} do nothing in data.stage=sentences (its two "
                   f"views differ by dropout only)")
    if d.packing != "document":
        out.append(f"data.packing={d.packing} does nothing in data.stage=sentences (a sample is one sentence)")
    spans = _changed(d.masking, MaskingConfig(), ("scheme", "span_p", "span_max"))
    if spans:
        out.append(f"data.masking.{', data.masking.'.join(spans)} do nothing in data.stage=sentences (its MLM "
                   f"masks single tokens); they act in data.stage=pretrain")
    return out


def _pretrain_stage_lines(cfg) -> list[str]:
    """data.stage=pretrain: the sentence stage's inputs, and augmentation or masking options nothing reads."""
    d, out = cfg.data, []
    for key in ("sentences", "pairs"):
        if getattr(d, key):
            out.append(f"data.{key}={getattr(d, key)!r} is not read by data.stage=pretrain (it reads "
                       f"data.sources); set data.stage=sentences to train on it")
    methods = set(d.augment.methods.split("+"))
    for method, names in _AUGMENT_OPTIONS.items():
        unused = _changed(d.augment, AugmentConfig(), names) if method not in methods else []
        if unused:
            out.append(f"data.augment.{', data.augment.'.join(unused)} do nothing: data.augment.methods="
                       f"{d.augment.methods!r} does not include {method}")
    if cfg.objective.nt_xent is None and d.augment.methods != AugmentConfig().methods:
        out.append(f"data.augment.methods={d.augment.methods!r} has no loss to act on: objective.nt_xent is off "
                   f"(the views are built but no term reads them)")
    if cfg.objective.nt_xent is not None and methods <= {"subs", "reorder"}:
        out.append(f"data.augment.methods={d.augment.methods!r} without a deletion: CLEAR's authors report that "
                   f"MLM + subs, + reorder and + subs+reorder either converge at once or explode (views too easy to "
                   f"tell apart) and do not report them; their best pairs are del-word+reorder and "
                   f"del-span+reorder")
    if cfg.objective.mlm is None:
        masking = _changed(d.masking, MaskingConfig(), [f.name for f in dataclasses.fields(MaskingConfig)])
        if masking:
            out.append(f"data.masking.{', data.masking.'.join(masking)} do nothing: objective.mlm is off")
    elif d.masking.scheme != "span":
        spans = _changed(d.masking, MaskingConfig(), ("span_p", "span_max"))
        if spans:
            out.append(f"data.masking.{', data.masking.'.join(spans)} do nothing: data.masking.scheme="
                       f"{d.masking.scheme} (they shape span masking)")
    return out


def _objective_lines(cfg) -> list[str]:
    """Objective options that cannot act with the rest of the config."""
    out, obj = [], cfg.objective
    nt = obj.nt_xent
    if nt is not None and nt.mean_pool_warmup_steps and cfg.model.pooling == "mean":
        out.append(f"objective.nt_xent.mean_pool_warmup_steps={nt.mean_pool_warmup_steps} does nothing: "
                   f"model.pooling is already mean (the warm-up blends mean pooling into [CLS]-style pooling)")
    compared = set(CONTRASTIVE_TERMS) & set(obj.enabled())
    names = ", ".join(CONTRASTIVE_TERMS)
    if obj.gradient_cache:
        if not compared:
            out.append(f"objective.gradient_cache=true does nothing: no enabled term compares sentences with each "
                       f"other ({names})")
        elif cfg.train.grad_accum == 1:
            out.append("objective.gradient_cache=true changes nothing with train.grad_accum=1 (each rank's micro-batch "
                       "already is its whole share of the step) and costs an extra forward pass; raise "
                       "train.grad_accum (lowering train.micro_batch_size) to hold less in memory")
    rd = obj.rank_distill
    if rd is not None and rd.method == "listmle" and rd.teacher_temperature != RankDistillConfig().teacher_temperature:
        out.append(f"objective.rank_distill.teacher_temperature={rd.teacher_temperature:g} does nothing with "
                   f"method=listmle: ListMLE reads only the order of the teachers' similarities (RankCSE's tau3 "
                   f"scales ListNet's teacher distribution); set method=listnet to use it")
    if obj.matryoshka is not None and not compared:
        out.append(f"objective.matryoshka does nothing: no enabled term compares sentences with each other ({names})")
    return out


def missing_paths(cfg) -> list[str]:
    """One line per data path a run cannot start without that ``cfg`` leaves empty, naming its key (what an empty
    path would otherwise fail on is a file called '')."""
    d = cfg.data
    out = []
    if not d.tokenizer:
        out.append("data.tokenizer is empty: set it to the tokenizer.json pretrain-tokenizer wrote (e.g. "
                   "data.tokenizer=runs/tokenizer/tokenizer.json)")
    if d.stage == "pretrain" and not d.sources:
        out.append("data.sources is empty: list the datasets pretrain-preprocess wrote (e.g. "
                   "'data.sources=[{name: wiki, path: data/wiki}]')")
    if not d.sources and not d.tokenizer:
        out.append("configs/quickstart.yaml leaves both to `python -m pretrain.quickstart`; `python -m "
                   "pretrain.quickstart RUN_DIR --prepare-only` writes them and RUN_DIR/data.yaml to add with "
                   "include=RUN_DIR/data.yaml")
    return out
