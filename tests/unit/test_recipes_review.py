"""The paper recipes in configs/recipes/, loaded through the project's own loader (``load_run_config``), against the
numbers their papers state. Each expected value is the paper's, with the passage it comes from; a value the paper
does not give is not checked here (the recipe's comments say where it comes from instead).

Papers (../shared/papers/): CLEAR (Wu et al. 2020), ArcCSE (Zhang et al. 2022), RankCSE (Liu et al. 2023), SARCSE
(Liu et al. 2024); SimCSE (Gao et al. 2021, arXiv 2104.08821) is cited by them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pretrain.config import load_run_config

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"
WIKI1M = 1_000_000
"""SimCSE Sec. 6.1: "We train unsupervised SimCSE on 10^6 randomly sampled sentences from English Wikipedia"; ArcCSE
Sec. 4.1 ("one million random sampled sentences from English Wikipedia"), RankCSE Sec. 5.1 and SARCSE Sec. 3.1
("the 1-million sentences") train on the same."""


def recipe(name: str, *overrides: str):
    return load_run_config(str(RECIPES / f"{name}.yaml"), list(overrides))


def sentences_per_step(cfg, ranks: int = 1) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum * ranks


# --- SimCSE -------------------------------------------------------------------------------------------------------

def test_unsupervised_simcse_selects_its_checkpoint_on_stsb_dev_every_250_steps():
    # SimCSE App. A: "For supervised SimCSE, we train our models for 3 epochs, evaluate the model every 250 training
    # steps on the development set of STS-B and keep the best checkpoint for the final evaluation on test sets. We do
    # the same for the unsupervised SimCSE, except that we train the model for one epoch."
    cfg = recipe("simcse_unsup_bert_base")
    assert cfg.eval.stsb_every == 250 and cfg.eval.keep_best
    assert recipe("simcse_sup_bert_base").eval.stsb_every == 250


def test_unsupervised_simcse_is_the_papers():
    cfg = recipe("simcse_unsup_bert_base")
    # Table A.1 (Unsupervised, BERT base): "Batch size 64", "Learning rate 3e-5".
    assert sentences_per_step(cfg) == 64 and cfg.optim.lr == 3e-5
    # App. A: "... except that we train the model for one epoch" over the 10^6 sentences.
    assert cfg.train.max_steps == math.ceil(WIKI1M / 64)
    # App. D, Table D.1: "with a carefully tuned temperature tau = 0.05".
    assert cfg.objective.enabled() == ["info_nce"] and cfg.objective.info_nce.temperature == 0.05
    # Sec. 3: "dropout masks placed on fully-connected layers as well as attention probabilities (default p = 0.1)".
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.1)
    # Sec. 6.3: "By default, we take [CLS] with MLP (train) for unsupervised SimCSE" ("keeping MLP during training but
    # removing it at testing time"); the MLP is BERT's pooler over [CLS] here.
    assert (cfg.model.pooling, cfg.model.pooler, cfg.model.projection_layers) == ("cls", True, 0)
    assert cfg.eval.pooling == "cls_before_pooler"
    # Sec. 6.1: "We start from pre-trained checkpoints of BERT (uncased)"; Sec. 6.1: 10^6 Wikipedia sentences.
    assert "bert-base-uncased" in cfg.checkpoint.init_from and "wiki1m" in cfg.data.sentences


def test_supervised_simcse_is_the_papers():
    cfg = recipe("simcse_sup_bert_base")
    # Table A.1 (Supervised, base): "Batch size 512", "Learning rate 5e-5"; App. A: "we train our models for 3 epochs".
    assert sentences_per_step(cfg) == 512 and cfg.optim.lr == 5e-5
    # Sec. 4, Eq. 5 / Sec. 6.3 Table 7: contradiction hypotheses as hard negatives, "alpha = 1 performs the best".
    assert cfg.objective.info_nce.hard_negative_weight == 1.0 and cfg.objective.info_nce.temperature == 0.05
    assert cfg.data.pairs and not cfg.data.sentences  # (premise, entailment, contradiction) rows
    # Sec. 6.3: "[CLS] with MLP for supervised SimCSE" (kept at test time, unlike the unsupervised model).
    assert (cfg.model.pooling, cfg.model.pooler, cfg.eval.pooling) == ("cls", True, "cls")
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.1)


# --- CLEAR --------------------------------------------------------------------------------------------------------

CLEAR_ROWS = {
    # Table 1 rows: "MLM+ del-word", "MLM+ del-span", "MLM+ subs+ del-span", "MLM+ del-span+ reorder"; Sec. 4.1:
    # "for CL, it substitutes 30% tokens first and then deletes 5 spans" (subs before del-span).
    "clear_del_word": "del-word",
    "clear_del_span": "del-span",
    "clear_subs_del_span": "subs+del-span",
    "clear_del_span_reorder": "del-span+reorder",
}


@pytest.mark.parametrize("name", sorted(CLEAR_ROWS))
def test_clear_recipes_are_the_papers_setup(name):
    cfg = recipe(name)
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    # Sec. 4.1 "Model configuration": "We use the Transformer (12 layers, 12 heads and 768 hidden size)".
    assert (m.num_layers, m.num_heads, m.hidden_size) == (12, 12, 768)
    # "Models are pre-trained for 500K updates, with minibatches containing 8,192 sequences of maximum length 512
    # tokens" ... "pre-trained on 256 NVIDIA Tesla V100 32GB GPUs".
    assert t.max_steps == 500_000 and sentences_per_step(cfg, ranks=256) == 8192
    assert d.max_len == 512 and d.view_max_len == 512 and m.max_position >= 512
    # "For the first 24,000 steps, the learning rate is warmed up to a peak value of 6e-4, then linearly decayed".
    assert (o.warmup_steps, o.lr, o.schedule, o.min_lr_ratio) == (24_000, 6e-4, "linear", 0.0)
    # "optimized by Adam with beta1 = 0.9, beta2 = 0.98, epsilon = 1e-6, and L2 weight decay of 0.01".
    assert (tuple(o.betas), o.eps, o.weight_decay) == ((0.9, 0.98), 1e-6, 0.01)
    # "We use 0.1 for dropout on all layers and in attention."
    assert (m.dropout, m.attention_dropout) == (0.1, 0.1)
    # "Hyperparameters for MLM": "we randomly mask 15% tokens" ... "adopt the 10%-random-replacement and
    # 10%-keep-unchanged setting in BERT" (so 80% [MASK]).
    assert (d.masking.prob, d.masking.mask_frac, d.masking.random_frac, d.masking.scheme) == (0.15, 0.8, 0.1, "token")
    # Eq. 3: L_total = L_MLM + L_CL.
    assert cfg.objective.enabled() == ["mlm", "nt_xent"]
    assert (cfg.objective.mlm.weight, cfg.objective.nt_xent.weight) == (1.0, 1.0)
    # "Hyperparameters for CL": "we delete 70% tokens"; "we delete 5 spans (each with 5% length of the input text)";
    # "we randomly pick 5 pairs of spans (each with roughly 5% length as well)"; "we randomly select 30% tokens".
    a = d.augment
    assert a.methods == CLEAR_ROWS[name]
    assert (a.del_word_rate, a.del_span_num, a.del_span_frac) == (0.7, 5, 0.05)
    assert (a.reorder_pairs, a.reorder_frac, a.subs_rate) == (5, 0.05, 0.3)
    # Sec. 3.1: "use the representation of a manually-inserted token as the vector of the sentence (i.e., [CLS])" and
    # "A nonlinear neural network projection head g(.)".
    assert m.pooling == "cls" and m.projection_layers >= 2
    # "Pre-training data: ... a combination of BookCorpus and English Wikipedia datasets".
    assert {s.name for s in d.sources} == {"wiki", "books"}


# --- ArcCSE -------------------------------------------------------------------------------------------------------

def test_arccse_is_the_papers():
    cfg = recipe("arccse_bert_base")
    o = cfg.objective
    # Sec. 4.1: "For ArcCon loss, we set the angular margin m to 10 degrees and the temperature tau to 0.05."
    assert (o.arccon.margin_deg, o.arccon.temperature) == (10.0, 0.05)
    # "we set the masking ratios as 20% and 40% respectively"; "we filter out sentences with less than 25 words";
    # "The loss coefficient lambda is set to 0.1"; Sec. 3.2: "here we set m to zero".
    assert (o.triplet.low, o.triplet.high, o.triplet.min_words) == (0.2, 0.4, 25)
    assert (o.triplet.weight, o.triplet.margin) == (0.1, 0.0)
    assert o.enabled() == ["arccon", "triplet"] and o.arccon.weight == 1.0  # Eq. 5: L = L_arccon + lambda L_tri
    # "The dropout rate is set to 0.1."
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.1)
    # "the learning rate is set to 3e-5 for base models"; "We search the batch size within {8, 16, 32} and always
    # update the parameters every 64 steps"; "We train our model for one epoch".
    t = cfg.train
    assert cfg.optim.lr == 3e-5 and t.micro_batch_size in (8, 16, 32) and t.grad_accum == 64
    assert t.max_steps == math.ceil(WIKI1M / sentences_per_step(cfg))
    # "The length is set to 32 for the ArcCon loss in large models, and to the maximum length within a batch for all
    # other cases": no cap below BERT's 512 positions for base.
    assert cfg.data.view_max_len >= 512 and o.triplet.max_len >= 512
    # "We evaluate our model every 125 training steps on the development set of STS-B" (read as micro-steps of the
    # 64 a parameter update takes: the nearest whole number of updates).
    assert cfg.eval.stsb_every == round(125 / t.grad_accum)
    # Sec. 4.1: "we use the output of the MLP layer on top of the [CLS] as the sentence representation during
    # training, and use the [CLS] output without MLP layer for evaluation".
    assert (cfg.model.pooling, cfg.model.pooler, cfg.eval.pooling) == ("cls", True, "cls_before_pooler")


# --- RankCSE ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, lr, tau2", [
    # Table 9, "BERT base" columns: listNet: learning rate 3e-5, tau2 0.025, tau3 0.0125; listMLE: 2e-5, 0.05, -.
    ("listnet", 3e-5, 0.025),
    ("listmle", 2e-5, 0.05),
])
def test_rankcse_is_table_9s_bert_base_column(method, lr, tau2):
    cfg = recipe(f"rankcse_{method}_bert_base")
    o = cfg.objective
    # App. A: "setting batch size to 128, temperature tau1 to 0.05, alpha to 1/3, beta to 1, gamma to 1 and the rate
    # of linear scheduling warm-up to 0.05 for all the experiments. We train our models for 4 epochs, and evaluate the
    # model every 125 steps on the dev set of STS-B".
    assert sentences_per_step(cfg) == 128 and cfg.optim.lr == lr
    assert o.info_nce.temperature == 0.05 and o.consistency.temperature == 0.05
    assert (o.info_nce.weight, o.consistency.weight, o.rank_distill.weight) == (1.0, 1.0, 1.0)  # Eq. 6
    w = o.rank_distill.mixing_weights()
    assert len(w) == 2 and w[0] == pytest.approx(1 / 3) and w[1] == pytest.approx(2 / 3)
    assert o.rank_distill.method == method and o.rank_distill.student_temperature == tau2
    if method == "listnet":
        assert o.rank_distill.teacher_temperature == 0.0125
        # Footnote 1 (Eq. 4, ListNet): "we exclude the score of the positive pair from the list".
        assert o.rank_distill.exclude_positive
    assert cfg.train.max_steps * 128 == 4 * WIKI1M
    assert cfg.optim.schedule == "linear" and abs(cfg.optim.warmup_steps - 0.05 * cfg.train.max_steps) <= 1
    assert cfg.eval.stsb_every == 125
    # Sec. 5.1: "We utilize the first two [SimCSE-BERT base, SimCSE-BERT large] as a multi-teacher".
    assert ["base" in o.rank_distill.teachers[0], "large" in o.rank_distill.teachers[1]] == [True, True]
    # App. A: "Following SimCSE, we utilize the embedding corresponding to [CLS] token as the representation".
    assert cfg.model.pooling == "cls" and cfg.eval.pooling == "cls_before_pooler"


# --- SARCSE -------------------------------------------------------------------------------------------------------

def test_sarcse_is_the_papers():
    cfg = recipe("sarcse_roberta_base")
    o = cfg.objective
    # Sec. 3.1 "Implementation Details": "the hyper-parameters of reconstruction theta and lambda are set to 0.1 and
    # 50. The tau in InfoNCE is set to 0.05. And the alpha beta and gamma in the training object are set to 1, 2.5e-4
    # and 2.5e-4. The output channels of TextCNN and CNN, co_t and co_c, are set to 500 and 3. We train SARCSE
    # through AdamW optimizer, and the learning rate is 1e-5. Finally, we set the mini-batch to 64 and the training
    # epoch to 1."
    r = o.reconstruction
    assert (r.theta, r.lam, o.info_nce.temperature) == (0.1, 50.0, 0.05)
    assert (o.info_nce.weight, r.weight, r.positive_weight) == (1.0, 2.5e-4, 2.5e-4)
    assert (r.channels, r.integrate_channels) == (500, 3)
    # Sec. 2.2, Eq. 3: "H_ks = TextCNN_ks(X), ks = 3, 4, 5".
    assert tuple(r.kernel_sizes) == (3, 4, 5)
    assert cfg.optim.lr == 1e-5 and sentences_per_step(cfg) == 64 and cfg.train.max_steps == math.ceil(WIKI1M / 64)
    # Sec. 2.2: "we obtain the sentence embeddings Z which could be used during inference": STS-B dev selects by Z
    # (eval.pooling empty = Z in a run with objective.reconstruction).
    assert cfg.eval.stsb_every > 0 and cfg.eval.pooling in ("", "autoencoder_z")
    # RoBERTa-base: "use the Roberta as the pretrained language models, including the base model".
    assert "roberta-base" in cfg.checkpoint.init_from and (cfg.model.num_layers, cfg.model.hidden_size) == (12, 768)


@pytest.mark.parametrize("name", ["simcse_unsup_bert_base", "simcse_sup_bert_base", "arccse_bert_base",
                                  "rankcse_listnet_bert_base", "rankcse_listmle_bert_base"])
def test_the_simcse_family_mlp_starts_at_berts_init_not_the_nsp_pooler(name):
    """The papers say "an MLP layer over [CLS]" and not how it starts; SimCSE's released code (models.py: cl_init
    builds ``MLPLayer`` and calls ``init_weights`` on a ``BertModel(add_pooling_layer=False)``, which ArcCSE's and
    RankCSE's code keep) starts it at BERT's init, while init_from bert-base-uncased loaded its NSP-trained pooler."""
    cfg = recipe(name)
    assert cfg.model.pooler and cfg.model.pooling in ("cls",) and cfg.model.projection_layers == 0
    assert cfg.checkpoint.fresh_pooler
