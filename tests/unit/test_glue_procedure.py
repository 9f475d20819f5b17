"""GLUE fine-tuning procedure against its references: transformers' Trainer / run_glue.py (schedule, weight-decay
groups, gradient clipping) and the *ForSequenceClassification heads (BERT reads its pooler, RoBERTa its own dense)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.eval.glue import FinetuneConfig, GlueModel, _optimizer, finetune
from pretrain.model import build_model
from test_eval_glue import BowBackbone, WordTokenizer  # the same stand-ins (tests/unit is on sys.path)

transformers = pytest.importorskip("transformers")


def tiny_bert(**kw):
    return build_model(ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, ffn_size=24,
                                   max_position=64, **kw), seed=0)


def glue_model(backbone, num_labels=2):
    return GlueModel(backbone, 16, num_labels, 0.1, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("total,ratio", [(100, 0.06), (2036, 0.06), (50, 0.1), (10, 0.0), (7, 0.5)])
def test_lr_per_update_is_transformers_linear_schedule(total, ratio):
    """The lr each update uses equals Trainer's: warmup = ceil(ratio * total) (TrainingArguments.get_warmup_steps),
    get_linear_schedule_with_warmup (0 at the first update when warming up, linear to 0 at the end)."""
    from transformers import TrainingArguments, get_linear_schedule_with_warmup

    cfg = FinetuneConfig(task="rte", lr=2e-5, warmup_ratio=ratio)
    opt, sched = _optimizer(nn.Linear(2, 2), cfg, total)
    ref_opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=cfg.lr)
    warmup = TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=ratio), total)
    ref = get_linear_schedule_with_warmup(ref_opt, warmup, total)
    ours, theirs = [], []
    for _ in range(total):
        ours.append(opt.param_groups[0]["lr"])
        theirs.append(ref_opt.param_groups[0]["lr"])
        opt.step(), sched.step(), ref_opt.step(), ref.step()
    assert ours == pytest.approx(theirs, abs=1e-15)


@pytest.mark.parametrize("backend", ["pretrain", "transformers"])
def test_weight_decay_groups_are_trainers(backend, tmp_path):
    """No decay on biases and LayerNorm weights, decay on the rest: the split of Trainer.get_decay_parameter_names."""
    from transformers import Trainer

    if backend == "pretrain":
        backbone = tiny_bert()
    else:
        from pretrain.eval.hf_backend import HFBackbone

        cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=24, max_position_embeddings=64)
        transformers.BertModel(cfg).save_pretrained(str(tmp_path))
        backbone = HFBackbone(tmp_path)
    model = glue_model(backbone)
    opt, _ = _optimizer(model, FinetuneConfig(task="rte"), 10)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = dict(model.named_parameters(remove_duplicate=False))  # a tied MLM decoder is the word table
    ref = set(Trainer.get_decay_parameter_names(None, model))
    assert decayed == {id(p) for n, p in names.items() if n in ref}
    assert any("norm" in n.lower() for n in set(names) - ref) and any(n.endswith("bias") for n in set(names) - ref)


def test_classifier_reads_the_bert_pooler_of_our_backbone():
    """A BERT backbone with a pooler: the classifier's input is the pooler's tanh(W h_cls + b), then dropout and one
    Linear (BertForSequenceClassification); the pooler is trained with the rest."""
    backbone = tiny_bert()
    model = glue_model(backbone).eval()
    seen = []
    model.head.out.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    ids = torch.randint(5, 64, (3, 9))
    mask = torch.ones_like(ids)
    model(ids, mask)
    h_BTD = backbone.encode(ids, mask)
    torch.testing.assert_close(seen[0], torch.tanh(backbone.pooler.dense(h_BTD[:, 0])))
    model.train()
    model(ids, mask)[:, 0].sum().backward()
    assert backbone.pooler.dense.weight.grad is not None and backbone.pooler.dense.weight.grad.abs().sum() > 0


def _copy_and_compare(ours: GlueModel, ref: nn.Module, ids, mask, types=None):
    ours.eval(), ref.eval()
    with torch.no_grad():
        got = ours(ids, mask, types)
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(got, want)


def test_transformers_bert_is_bert_for_sequence_classification(tmp_path):
    """--backend transformers on a BERT directory gives BertForSequenceClassification's logits (its pooler, dropout,
    one Linear) once the classifier weights are the same."""
    from pretrain.eval.hf_backend import HFBackbone

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(str(tmp_path))
    ours = glue_model(HFBackbone(tmp_path), num_labels=3)
    ref = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path), num_labels=3)
    ref.classifier.load_state_dict(ours.head.out.state_dict())
    ids = torch.randint(5, 64, (3, 9))
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    _copy_and_compare(ours, ref, ids, torch.ones_like(ids), types)


def test_transformers_roberta_keeps_robertas_head(tmp_path):
    """A RoBERTa has no pooler its classifier reads: dropout -> dense -> tanh -> dropout -> out_proj on <s>
    (RobertaClassificationHead), as before."""
    from pretrain.eval.hf_backend import HFBackbone

    cfg = transformers.RobertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=40, type_vocab_size=1,
                                     pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    transformers.RobertaModel(cfg).save_pretrained(str(tmp_path))
    ours = glue_model(HFBackbone(tmp_path))
    ref = transformers.RobertaForSequenceClassification.from_pretrained(str(tmp_path), num_labels=2)
    ref.classifier.dense.load_state_dict(ours.head.dense.state_dict())
    ref.classifier.out_proj.load_state_dict(ours.head.out.state_dict())
    ids = torch.randint(5, 64, (3, 9))
    _copy_and_compare(ours, ref, ids, torch.ones_like(ids))


@pytest.mark.parametrize("backend", ["pretrain", "transformers"])
def test_a_bert_without_pooler_gets_robertas_head_in_both_backends(backend, tmp_path):
    """model.pooler=false: no pooler to read (its to-hf BertModel holds zeros there, config.json says so), so both
    backends give RoBERTa's head with its own dense, as ours trains it."""
    from tokenizers import Tokenizer, models

    from pretrain.eval.encoder import load_backbone
    from pretrain.export.hf import export_hf

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])}
    Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    model = build_model(ModelConfig(vocab_size=len(vocab), hidden_size=16, num_layers=1, num_heads=2, ffn_size=24,
                                    max_position=64, pooler=False), seed=0)
    export_hf(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "hf"))
    backbone, _ = load_backbone(tmp_path / "hf", backend=backend)
    model = glue_model(backbone)
    assert model.pooler is None and model.head.dense is not None


def test_gradients_are_clipped_to_norm_1_before_each_update(tmp_path, monkeypatch):
    """Trainer's max_grad_norm=1.0 (BERT's clip_by_global_norm 1.0): the global gradient norm an update sees is at
    most 1 (STS-B targets near 5 give an unclipped norm far above it)."""
    norms = []
    step = torch.optim.AdamW.step

    def recording_step(self, *a, **k):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    rng = np.random.default_rng(0)
    words = "movie plot actor scene film story".split()
    rows = [head] + [f"{i}\tm\tf\t2012\t{i}\tn\tn\t{' '.join(rng.choice(words, 3))}\t{' '.join(rng.choice(words, 3))}"
                     f"\t{4.5 + (i % 2) * 0.5:.3f}" for i in range(16)]
    for split in ("train", "dev"):
        (tmp_path / "glue/STS-B").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"glue/STS-B/{split}.tsv").write_text("\n".join(rows) + "\n")
    cfg = FinetuneConfig(task="stsb", lr=1e-3, batch_size=8, epochs=1, seed=1)
    finetune(cfg, BowBackbone(), WordTokenizer(), tmp_path / "glue", log=lambda *_: None)
    assert len(norms) == 2 and max(norms) <= 1.0 + 1e-5, norms


def test_cli_passes_max_grad_norm():
    """--max-grad-norm defaults to Trainer's 1.0 and reaches FinetuneConfig (0 = RoBERTa's no clipping)."""
    from pretrain.eval import glue_cli

    args = glue_cli.build_parser().parse_args(["--out", "x"])
    assert args.max_grad_norm == 1.0 and FinetuneConfig(task="rte").max_grad_norm == 1.0
    assert glue_cli.build_parser().parse_args(["--out", "x", "--max-grad-norm", "0"]).max_grad_norm == 0.0
    with pytest.raises(ValueError, match="max_grad_norm"):
        FinetuneConfig(task="rte", max_grad_norm=-1.0)


def _modern_hf_config(**kw):
    return transformers.ModernBertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                         intermediate_size=24, max_position_embeddings=64, local_attention=4,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                         sep_token_id=2, **kw)


def _padded_batch(vocab: int):
    """Three sequences of 9, 6 and 4 tokens, right-padded with id 0 (mean pooling must skip the padding)."""
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, n in enumerate((9, 6, 4)):
        ids[row, n:], mask[row, n:] = 0, 0
    return ids, mask


def _compare_with_modernbert_classifier(ours: GlueModel, ref: nn.Module, vocab: int):
    """Copy our new head's weights into ModernBertForSequenceClassification's (head.dense, head.norm, classifier);
    the logits agree in eval mode."""
    with torch.no_grad():
        ref.head.dense.load_state_dict(ours.head.dense.state_dict())
        ref.head.norm.load_state_dict(ours.head.norm.state_dict())
        ref.classifier.load_state_dict(ours.head.out.state_dict())
    ours.eval(), ref.eval()
    ids, mask = _padded_batch(vocab)
    with torch.no_grad():
        got = ours(ids, mask, torch.zeros_like(ids))
        want = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("head", [{}, {"classifier_pooling": "mean", "classifier_bias": True, "norm_bias": True,
                                       "classifier_activation": "silu", "norm_eps": 1e-3}])
def test_transformers_modernbert_is_modernbert_for_sequence_classification(head, tmp_path):
    """--backend transformers on a ModernBERT directory gives ModernBertForSequenceClassification's logits: its
    classifier_pooling (cls, or mean over the attention mask), dense (classifier_bias) -> classifier_activation ->
    LayerNorm(norm_eps, norm_bias) -> dropout -> Linear, as its config states them."""
    from pretrain.eval.hf_backend import HFBackbone

    torch.manual_seed(0)
    transformers.ModernBertModel(_modern_hf_config(**head)).save_pretrained(str(tmp_path))
    ours = glue_model(HFBackbone(tmp_path), num_labels=3)
    ref = transformers.ModernBertForSequenceClassification.from_pretrained(str(tmp_path), num_labels=3)
    _compare_with_modernbert_classifier(ours, ref, 64)


def _our_modernbert_export(tmp_path, **kw):
    """A random tiny model.arch=modernbert and its to-hf export directory."""
    from tokenizers import Tokenizer, models

    from pretrain.export.hf import export_hf

    vocab = {t: i for i, t in enumerate(["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]", *"abcdefghijklmnop"])}
    Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    model = build_model(ModelConfig(arch="modernbert", pooler=False, vocab_size=len(vocab), hidden_size=16,
                                    num_layers=3, num_heads=2, ffn_size=24, local_window=4, layer_norm_eps=1e-5,
                                    max_position=64, **kw), seed=0)
    export_hf(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "hf"))
    return model, tmp_path / "hf", len(vocab)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_our_modernbert_is_modernbert_for_sequence_classification(activation, tmp_path):
    """Ours at model.arch=modernbert gets the head ModernBertForSequenceClassification builds on its to-hf export
    (cls pooling, no biases, the model's activation and layer_norm_eps): same logits with the same head weights."""
    model, hf_dir, vocab = _our_modernbert_export(tmp_path, activation=activation)
    ours = glue_model(model.eval(), num_labels=3)
    ref = transformers.ModernBertForSequenceClassification.from_pretrained(str(hf_dir), num_labels=3)
    _compare_with_modernbert_classifier(ours, ref, vocab)


@pytest.mark.parametrize("backend", ["pretrain", "transformers"])
def test_modernbert_head_is_initialised_as_transformers_does(backend, tmp_path):
    """ModernBertPreTrainedModel._init_weights: the head's dense ~ N(0, initializer_range / sqrt(2 num_layers)) and
    the classifier ~ N(0, hidden_size ** -0.5), both truncated at initializer_cutoff_factor (2) stds; biases 0,
    LayerNorm weight 1 (a wider model, so that the spreads are measured well)."""
    from pretrain.eval.encoder import load_backbone

    cfg = ModelConfig(arch="modernbert", pooler=False, vocab_size=32, hidden_size=128, num_layers=2, num_heads=2,
                      ffn_size=32, init_std=0.05, layer_norm_eps=1e-5)
    model = build_model(cfg, seed=0)
    if backend == "transformers":
        from pretrain.export.hf import export_hf
        from tokenizers import Tokenizer, models

        vocab = {t: i for i, t in enumerate(["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"])}
        Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
        export_hf(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "hf"))
        model, _ = load_backbone(tmp_path / "hf", backend="transformers")
    ours = GlueModel(model, 128, 8, None, torch.Generator().manual_seed(0)).head
    for lin, std in ((ours.dense, 0.05 / 2.0), (ours.out, 128 ** -0.5)):
        w = lin.weight.detach()
        assert w.abs().max() <= 2 * std and w.abs().max() > 1.9 * std
        assert w.std().item() == pytest.approx(0.880 * std, rel=0.1)  # N(0, 1) cut at +-2 has std 0.880
        assert lin.bias is None or not lin.bias.any()
    assert (ours.norm.weight == 1).all() and ours.drop.p == 0.0  # classifier_dropout: transformers' default 0
