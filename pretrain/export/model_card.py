"""The model card (README.md) ``pretrain-convert to-hf`` writes into an export.

What was trained (architecture, sentence embedding), on what data, with which objective terms and for how
many steps (from the checkpoint's config.yaml and trainer_state.json, or a run's best/ with best.json); the
evaluations found in the run directory (``pretrain-eval --out`` -> eval.md, ``pretrain-finetune-glue`` ->
results.md) copied in as they are; and how to load the export with transformers and sentence-transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.checkpoint import store
from pretrain.export.hf import hf_family
from pretrain.export.recorded import matryoshka_dims

EVAL_FILES = {"eval.md": "STS and sentence-embedding evaluation (`pretrain-eval`)",
              "results.md": "GLUE fine-tuning (`pretrain-finetune-glue`)"}


def run_record(w) -> dict:
    """{"run_dir", "step", "config" (the full run config when known), "what"} of the weights behind an export
    (Weights of ours): a checkpoint's run, a run's best/ (best.json + run_config.yaml), or nothing known."""
    info: dict = {"run_dir": None, "step": None, "config": w.run_config, "what": None}
    if w.kind == "checkpoint":
        tag = store.resolve_tag_dir(w.path)
        state = json.loads((tag / store.STATE_FILE).read_text(encoding="utf-8"))
        info.update(run_dir=tag.parent.parent, step=state.get("step"), state=state,
                    what=f"checkpoint `{tag.name}`")
    elif (w.path / "best.json").is_file():  # a run's best/ (kept by eval.stsb_every)
        import yaml

        best = json.loads((w.path / "best.json").read_text(encoding="utf-8"))
        full = w.path / "run_config.yaml"
        if full.is_file():
            info["config"] = yaml.safe_load(full.read_text(encoding="utf-8")) or w.run_config
        info.update(run_dir=w.path.parent, step=best.get("step"),
                    what=f"the best STS-B dev weights (Spearman {best.get('stsb_dev_spearman', float('nan')):.2f} "
                         f"at step {best.get('step')})")
    return info


OBJECTIVE_SETTINGS = {"gradient_cache": "contrastive batch = the whole optimizer step (cached gradients)",
                      "matryoshka": "Matryoshka sizes"}
"""Keys of the objective that are settings of the whole objective, not terms (config/objective.py: SETTINGS)."""


def _objective_lines(objective: dict) -> list[str]:
    lines = []
    for name, term in (objective or {}).items():
        if term is None or term is False:
            continue
        if name in OBJECTIVE_SETTINGS:
            detail = f": dims {term.get('dims')}, weights {term.get('weights') or 'all 1'}" \
                if isinstance(term, dict) else ""
            lines.append(f"- {OBJECTIVE_SETTINGS[name]} (`{name}`){detail}")
            continue
        term = dict(term) if isinstance(term, dict) else {}
        weight = term.pop("weight", 1.0)
        rest = ", ".join(f"{k} {json.dumps(v)}" for k, v in term.items() if not isinstance(v, (dict, list)))
        lines.append(f"- `{name}`, weight {weight}" + (f" ({rest})" if rest else ""))
    return lines or ["- (none recorded)"]


def _data_lines(data: dict) -> list[str]:
    lines = []
    if data.get("stage") == "sentences" and data.get("pairs"):
        lines.append(f"- pairs: `{data.get('pairs')}` (sentence stage: anchor, positive[, hard negative] rows)")
    elif data.get("stage") == "sentences":
        lines.append(f"- sentences: `{data.get('sentences')}` (sentence stage: one sentence per line)")
    else:
        for src in data.get("sources") or []:
            lines.append(f"- `{src.get('name')}`: `{src.get('path')}` (weight {src.get('weight', 1.0)})")
    if data.get("augment") and data.get("stage") != "sentences":
        lines.append(f"- views for the contrastive terms: augmentation `{data['augment'].get('methods')}`")
    lines.append(f"- tokenizer: `{data.get('tokenizer')}`; max length {data.get('max_len')} tokens")
    return lines


def _embedding_line(cfg, pooling: str) -> str:
    how = {"cls": "the [CLS] token" + (" through BERT's pooler (dense + tanh)" if cfg.pooler else ""),
           "cls_before_pooler": "the [CLS] token (before BERT's pooler)",
           "mean": "the mean of the token states (padding excluded)",
           "first_last_avg": "the mean over tokens of (first layer + last layer) / 2"}[pooling]
    parts = [how]
    if cfg.dense_dim:
        parts.append(f"a Dense layer to {cfg.dense_dim} dimensions ({cfg.dense_activation})")
    if cfg.normalize:
        parts.append("L2 normalisation")
    return ", then ".join(parts)


def _evaluations(run_dir: Path | None, out_dir: Path, pooling: str) -> list[str]:
    """The evaluations found in the run directory, each with where it came from; an STS evaluation also says which
    embedding it measured (its eval.json), and says so loudly when that is not the export's ``pooling``."""
    if run_dir is None or not run_dir.is_dir():
        return []
    found = []
    for name, title in EVAL_FILES.items():
        for depth in ("", "*/", "*/*/"):
            for f in sorted(run_dir.glob(depth + name)):
                if out_dir.resolve() in f.resolve().parents or "checkpoints" in f.parts:
                    continue
                if not f.resolve().is_relative_to(run_dir.resolve()):  # a link out of a handed run directory would
                    continue  # copy any file the user can read into a card they publish
                found += [f"### {title}", "", f"From `{f.relative_to(run_dir)}` in the run directory"
                          + _measured(f.with_name("eval.json"), run_dir, pooling) + ":", "",
                          f.read_text(encoding="utf-8").strip(), ""]
    return found


def _measured(record: Path, run_dir: Path, pooling: str) -> str:
    """What ``pretrain-eval``'s eval.json says it measured: the pooling (and checkpoint), and a warning when the
    pooling is not the export's (a user evaluated --pooling mean of a run that exports [CLS]: the card showed 82.4
    for an embedding the export does not compute, 73.6). A record outside the run directory (a link) is not read."""
    if not record.resolve().is_relative_to(run_dir.resolve()):
        return ""
    try:
        args = json.loads(record.read_text(encoding="utf-8")).get("args", {})
        measured, checkpoint = str(args["pooling"]), args.get("checkpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    where = f", checkpoint `{checkpoint}`" if checkpoint else ""
    if measured == pooling:
        return f" (pooling `{measured}`{where}, as this export embeds)"
    return (f" (pooling `{measured}`{where}; **not this export's embedding, which is pooling `{pooling}`: these "
            f"figures are of another embedding of the same weights**)")


def card_title(info: dict, source: Path, out_dir: Path) -> str:
    """The card's title: the run's name (its directory's) with the step, e.g. "quickstart (step 600)"; for an import
    without a run, the source directory's name; never the export folder's own name ("hf")."""
    run_dir = info.get("run_dir")
    name = Path(run_dir).resolve().name if run_dir is not None else Path(source).resolve().name
    if not name or name in (out_dir.name, "checkpoints"):
        name = Path(source).resolve().parent.name or out_dir.name
    return f"{name} (step {info['step']})" if info.get("step") is not None else name


def _training_lines(info: dict, config: dict) -> list[str]:
    """The card's Training section: steps, batch, precision, start, objective terms and data (or why there are
    none)."""
    lines: list[str] = []
    if config.get("objective"):
        train = config.get("train") or {}
        state = info.get("state") or {}
        batch = state.get("global_batch") or (train.get("micro_batch_size", 0) * train.get("grad_accum", 1))
        step = info["step"]
        # the run's total (tokens_seen_scope run); written before 2026-12-07: rank 0's own count
        tokens = int(state.get("tokens_seen") or 0) * (1 if state.get("tokens_seen_scope") == "run"
                                                         else int(state.get("world_size") or 1))
        lines += [f"- steps: {step if step is not None else '?'} (train.max_steps {train.get('max_steps')}), "
                  f"global batch {batch}" + (f", {tokens:,} tokens seen" if tokens else ""),
                  f"- precision {train.get('precision', '?')}; optimizer lr {(config.get('optim') or {}).get('lr')}, "
                  f"seed {config.get('seed')}"]
        init = (config.get("checkpoint") or {}).get("init_from")
        lines += [f"- started from: `{init}`" if init else "- started from: random initialisation", "",
                  "Objective terms (their sum is the loss):", "", *_objective_lines(config["objective"]), "",
                  "Data:", "", *_data_lines(config.get("data") or {}), ""]
    elif config.get("converted_from"):
        lines += [f"Not trained here: converted from `{config['converted_from']}` by `pretrain-convert from-hf`; "
                  "its own card tells how it was trained.", ""]
    else:
        lines += ["No training record found next to these weights.", ""]
    return lines


def build_model_card(w, *, pooling: str, out_dir: str, mlm_head: bool, projection: bool) -> str:
    """README.md text for the export of ``w`` (Weights of one of our checkpoints or init directories)."""
    cfg = w.model_cfg
    info = run_record(w)
    title, name = card_title(info, w.path, Path(out_dir)), Path(out_dir).name  # name: the folder the snippets load
    config = info["config"] or {}
    lines = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
             "tags: [sentence-transformers, feature-extraction, sentence-similarity, pretrain]", "---", "",
             f"# {title}", ""]
    num_params = sum(v.numel() for k, v in w.state.items() if not k.startswith(("projection.", "mlm_head.")))
    lines += [f"{_kind(cfg)}{cfg.num_layers} layers, hidden size {cfg.hidden_size}, {cfg.num_heads} heads, "
              f"feed-forward {cfg.ffn_size}, vocabulary {cfg.vocab_size}; {num_params / 1e6:.1f}M parameters "
              f"without the heads) written by `pretrain-convert to-hf` from {info['what'] or f'`{w.path}`'}.", "",
              f"Sentence embedding ({cfg.sentence_dim} dimensions): {_embedding_line(cfg, pooling)}.", ""]
    lines += ["## Training", "", *_training_lines(info, config)]
    evals = _evaluations(info["run_dir"], Path(out_dir), pooling)
    lines += ["## Evaluation", "", *(evals or ["No evaluation found in the run directory (`pretrain-eval --out "
                                               "RUN_DIR/eval` writes one; re-export to include it).", ""])]
    lines += ["## Usage", "", "sentence-transformers (`pip install sentence-transformers`):", "", "```python",
              "from sentence_transformers import SentenceTransformer", "",
              f'model = SentenceTransformer("path/to/{name}")',
              'embeddings = model.encode(["A man is playing a guitar.", "Someone plays an instrument."])',
              "print(model.similarity(embeddings, embeddings))", "```", "",
              "transformers (`pip install transformers`), the same embeddings:", "", "```python",
              "import torch", "from transformers import AutoModel, AutoTokenizer", "",
              f'tokenizer = AutoTokenizer.from_pretrained("path/to/{name}")',
              f'model = AutoModel.from_pretrained("path/to/{name}").eval()',
              'batch = tokenizer(["A man is playing a guitar."], padding=True, return_tensors="pt")',
              "with torch.no_grad():", *_usage_pooling(cfg, pooling), "```", ""]
    if mlm_head:
        head = {"modernbert": "ModernBERT's", "bert": "BERT's"}.get(hf_family(cfg), "RoBERTa's")
        lines += [f"The masked-language-model head is in `mlm/` (the encoder with {head} MLM head):", "", "```python",
                  "from transformers import AutoModelForMaskedLM", "",
                  f'mlm = AutoModelForMaskedLM.from_pretrained("path/to/{name}", subfolder="mlm")', "```", ""]
    dims = matryoshka_dims(config)
    if dims:
        lines += ["## Matryoshka embeddings", "",
                  f"Trained so that the first d coordinates of the embedding are an embedding themselves, for d in "
                  f"{', '.join(map(str, dims))} (`objective.matryoshka`; recorded in config.json as "
                  "`pretrain.matryoshka_dims`). Truncate with sentence-transformers:", "", "```python",
                  f'model = SentenceTransformer("path/to/{name}", truncate_dim={dims[-1]})', "```", "",
                  "or take `embedding[..., :d]` (and re-normalise for cosine similarity) with transformers.", ""]
    if not cfg.pooler and cfg.arch == "bert":  # ModernBertModel has no pooler_output at all
        lines += ["This model has no BERT pooler: `pooler_output` is all zeros.", ""]
    if projection:
        lines += ["`pretrain_projection.safetensors` holds the contrastive projection head used in training only "
                  "(`pretrain-convert from-hf` reads it back with the rest).", ""]
    return "\n".join(lines)


def _kind(cfg) -> str:
    """The card's first words: which encoder, as transformers knows it (hf.hf_family)."""
    family = hf_family(cfg)
    if family == "modernbert":
        return (f"A ModernBERT encoder (rotary positions, GeGLU, local attention over {cfg.local_window} tokens, "
                f"global attention every {cfg.global_every} layers; ")
    if family == "roberta":
        return "A RoBERTa encoder (transformers' RobertaModel; "
    if family == "roberta-prelayernorm":
        return "A pre-LN encoder (transformers' RobertaPreLayerNormModel; "
    return "A BERT encoder ("


def _usage_pooling(cfg, pooling: str) -> list[str]:
    """The transformers lines that compute the sentence embedding the sentence-transformers modules compute."""
    if pooling == "first_last_avg":
        lines = ["    out = model(**batch, output_hidden_states=True)",
                 "h = (out.hidden_states[1] + out.hidden_states[-1]) / 2  # first and last layer"]
    else:
        lines = ["    out = model(**batch)", "h = out.last_hidden_state"]
    if pooling == "cls" and cfg.pooler:
        lines.append("embedding = out.pooler_output  # [CLS] through BERT's pooler")
    elif pooling in ("cls", "cls_before_pooler"):
        lines.append("embedding = h[:, 0]  # [CLS]")
    else:
        lines += ["mask = batch['attention_mask'].unsqueeze(-1).float()",
                  "embedding = (h * mask).sum(1) / mask.sum(1)  # mean over tokens"]
    if cfg.dense_dim:
        lines.append(f"# then the Dense layer ({cfg.dense_dim} dimensions, {cfg.dense_activation}) of the Dense "
                     "module folder named in modules.json")
    if cfg.normalize:
        lines.append("embedding = torch.nn.functional.normalize(embedding, dim=-1)")
    return lines
