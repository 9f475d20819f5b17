"""GLUE readers (fixtures in the published formats, real-data counts), metrics vs sklearn, fine-tuning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from pretrain.eval import glue_cli
from pretrain.eval.glue import FinetuneConfig, finetune, linear_warmup_decay
from pretrain.eval.glue_data import TASKS, compute_metrics, get_task, read_split


def write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


MNLI_HEAD = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
             "sentence2_parse\tsentence1\tsentence2")


@pytest.fixture
def glue_fixture(tmp_path):
    """One small file per task in the GLUE distribution's format (incl. QQP, MNLI, WNLI)."""
    g = tmp_path / "glue"
    write(g / "CoLA/train.tsv", ["gj04\t1\t\tThe sailors rode the breeze.", "gj04\t0\t*\tThe rope stretched \"over."])
    write(g / "SST-2/train.tsv", ["sentence\tlabel", "a charming journey \t1", "bleak \"and\" desperate \t0"])
    write(g / "MRPC/train.tsv", ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
                                 "1\t1\t2\tHe said \"yes.\tHe agreed.", "0\t3\t4\tA cat.\tA dog."])
    write(g / "STS-B/train.tsv", ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
                                  "0\tmain\tMSRvid\t2012\t0\tnone\tnone\tA plane.\tAn air plane.\t5.000"])
    write(g / "QQP/train.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                                "0\t1\t2\tHow do I \"learn\"?\tHow to learn?\t1", "1\t3\t4\tWhy?\tWhen?\t0"])
    write(g / "MNLI/train.tsv", [MNLI_HEAD + "\tlabel1\tgold_label",
                                 "0\t1\t1n\tgov\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tPremise one.\tHypo one.\tneutral\tneutral"])
    write(g / "MNLI/dev_matched.tsv", [MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
                                       "0\t1\t1e\tgov\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tP.\tH.\tentailment\t"
                                       "entailment\tneutral\tentailment\tentailment\tentailment",
                                       "1\t2\t2c\tgov\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tP2.\tH2.\tcontradiction\t"
                                       "neutral\tneutral\tcontradiction\tcontradiction\t-"])
    write(g / "QNLI/train.tsv", ["index\tquestion\tsentence\tlabel", "0\tWhat?\tThis.\tnot_entailment"])
    write(g / "RTE/train.tsv", ["index\tsentence1\tsentence2\tlabel", "0\tNo weapons.\tWeapons.\tnot_entailment"])
    write(g / "WNLI/train.tsv", ["index\tsentence1\tsentence2\tlabel", "0\tI stuck a pin.\tThe pin had a hole.\t1"])
    return g


def test_readers_published_formats(glue_fixture):
    cola = read_split(get_task("cola"), glue_fixture, "train")
    assert cola.text_a[1] == 'The rope stretched "over.' and cola.text_b is None and list(cola.label) == [1, 0]
    sst = read_split(get_task("SST-2"), glue_fixture, "train")
    assert sst.text_a[1] == 'bleak "and" desperate ' and list(sst.label) == [1, 0]
    mrpc = read_split(get_task("mrpc"), glue_fixture, "train")  # BOM-prefixed header
    assert mrpc.text_a[0] == 'He said "yes.' and mrpc.text_b[0] == "He agreed."
    stsb = read_split(get_task("sts-b"), glue_fixture, "train")
    assert stsb.label.dtype == np.float32 and stsb.label[0] == 5.0 and stsb.text_b[0] == "An air plane."
    qqp = read_split(get_task("qqp"), glue_fixture, "train")
    assert qqp.text_a[0] == 'How do I "learn"?' and list(qqp.label) == [1, 0]
    mnli = read_split(get_task("mnli"), glue_fixture, "train")
    assert mnli.text_a == ["Premise one."] and mnli.label[0] == TASKS["mnli"].labels.index("neutral")
    mdev = read_split(get_task("mnli"), glue_fixture, "dev_matched")  # gold '-' rows are dropped
    assert mdev.text_b == ["H."] and mdev.label[0] == TASKS["mnli"].labels.index("entailment")
    assert read_split(get_task("qnli"), glue_fixture, "train").label[0] == 1
    assert read_split(get_task("rte"), glue_fixture, "train").text_b == ["Weapons."]
    assert read_split(get_task("wnli"), glue_fixture, "train").label[0] == 1
    with pytest.raises(FileNotFoundError):
        read_split(get_task("qqp"), glue_fixture, "dev")
    with pytest.raises(ValueError):
        get_task("squad")


def test_metrics_match_sklearn():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    m = compute_metrics(get_task("cola"), p, y)
    assert m["mcc"] == pytest.approx(100 * matthews_corrcoef(y, p))
    m = compute_metrics(get_task("mrpc"), p, y)
    assert m["f1"] == pytest.approx(100 * f1_score(y, p)) and m["acc"] == pytest.approx(100 * accuracy_score(y, p))
    assert m["score"] == pytest.approx((m["f1"] + m["acc"]) / 2)
    s, t = rng.standard_normal(50), rng.standard_normal(50)
    m = compute_metrics(get_task("stsb"), s, t)
    assert m["pearson"] == pytest.approx(100 * pearsonr(s, t)[0])
    assert m["spearman"] == pytest.approx(100 * spearmanr(s, t)[0])


def test_warmup_schedule():
    """transformers' get_linear_schedule_with_warmup: 0 at the first update, 1 at update ``warm``, then down to 0
    (test_glue_procedure.py compares it with transformers' own, step by step)."""
    total, warm = 100, 6
    lrs = [linear_warmup_decay(s, total, warm) for s in range(total)]
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(5 / 6)
    assert lrs[6] == pytest.approx(94 / 94) and lrs[-1] == pytest.approx(1 / 94)
    assert all(a >= b for a, b in zip(lrs[6:], lrs[7:]))


class WordTokenizer:
    """Whitespace tokenizer stand-in with the Tokenizer interface (ids 0..3 are specials)."""

    pad_id, cls_id, sep_id = 0, 1, 2

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, 4 + len(self.vocab)) for w in text.lower().split()]


class BowBackbone(nn.Module):
    """encode(ids, mask) -> h_BTD whose [CLS] row is the masked mean of word embeddings."""

    hidden_size = 16

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 16)

    def encode(self, input_ids_BT, attention_mask_BT, all_layers=False):
        h = self.emb(input_ids_BT)
        m = attention_mask_BT.unsqueeze(-1).float()
        mean = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        return torch.cat([mean, h[:, 1:]], dim=1)


def test_finetune_learns_and_cli_summary(tmp_path):
    rng = np.random.default_rng(0)
    words = "movie plot actor scene film story".split()
    rows = ["sentence\tlabel"]
    for i in range(64):
        lab = i % 2
        ws = list(rng.choice(words, 4)) + (["good"] if lab else ["bad"])
        rng.shuffle(ws)
        rows.append(" ".join(ws) + f"\t{lab}")
    write(tmp_path / "glue/SST-2/train.tsv", rows)
    write(tmp_path / "glue/SST-2/dev.tsv", rows)
    cfg = FinetuneConfig(task="sst2", lr=5e-2, batch_size=16, epochs=4, seed=3, dropout=0.0)
    torch.manual_seed(123)
    backbone = BowBackbone()
    before = torch.get_rng_state()
    res = finetune(cfg, backbone, WordTokenizer(), tmp_path / "glue", log=lambda *_: None)
    assert torch.equal(torch.get_rng_state(), before)  # global RNG untouched
    assert res["steps"] == 16 and len(res["history"]) == 4
    assert res["best"]["acc"] == 100.0
    assert res["history"][0]["loss"] > res["history"][-1]["loss"]
    # summary / markdown in CLEAR's Table 1 layout from run files
    out = tmp_path / "out"
    for seed, score in ((1, 70.0), (2, 80.0), (3, 90.0)):
        p = glue_cli.run_path(out, "rte", 2e-5, seed)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"task": "RTE", "config": {"lr": 2e-5, "seed": seed, "epochs": 10},
                                 "num_train": 10, "best": {"score": score, "acc": score}, "wall_s": 1.0}))
    summary = glue_cli.summarize(out, "m")
    assert summary["RTE"]["score"] == 80.0  # median over seeds
    md = (out / "results.md").read_text().splitlines()
    assert md[0].startswith("| Method | MNLI | QNLI | QQP | RTE | SST-2 | MRPC | CoLA | STS | Avg |")
    assert md[2].split("|")[5].strip() == "80.00"


def test_cli_grid_and_run_index(capsys):
    args = glue_cli.build_parser().parse_args(["--tasks", "rte,mrpc", "--lrs", "1e-5,2e-5", "--seeds", "1,2",
                                               "--out", "x"])
    entries = glue_cli.grid(args)
    assert len(entries) == 8 and entries[0] == ("rte", 1e-5, 1) and entries[-1] == ("mrpc", 2e-5, 2)
    glue_cli.main(["--tasks", "all", "--out", "x", "--count-runs"])
    assert capsys.readouterr().out.strip() == str(len(TASKS) * 3)
    glue_cli.main(["--tasks", "rte,mrpc", "--lrs", "1e-5,2e-5", "--out", "x", "--list-runs"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5 and lines[0].startswith("0\trte\tlr 1e-05\tseed 1") and "RTE" in lines[0]
    assert lines[-1].startswith("4 runs (sbatch --array=0-3")


# Labelled rows per split in ../shared/data/glue (MANIFEST §3; quoting disabled).
GLUE_COUNTS = {("cola", "train"): 8551, ("cola", "dev"): 1043, ("sst2", "train"): 67349, ("sst2", "dev"): 872,
               ("mrpc", "train"): 3668, ("mrpc", "dev"): 408, ("stsb", "train"): 5749, ("stsb", "dev"): 1500,
               ("rte", "train"): 2490, ("rte", "dev"): 277, ("qnli", "dev"): 5463}


def test_real_glue_counts(data_dir):
    for (task, split), n in GLUE_COUNTS.items():
        assert len(read_split(get_task(task), data_dir / "glue", split)) == n, (task, split)


def test_cli_names_the_checkpoint_and_takes_checkpoint_best(tmp_path, capsys):
    """Given a run directory, pretrain-finetune-glue resolves --checkpoint before anything slow: a run without
    best/ gets a one-line error listing what it has."""
    import json

    import pytest

    from pretrain.checkpoint import store

    tag = tmp_path / "run" / "checkpoints" / store.tag_for_step(5)
    tag.mkdir(parents=True)
    (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": 5}))
    with pytest.raises(SystemExit) as e:
        glue_cli.main(["--model", str(tmp_path / "run"), "--checkpoint", "best", "--tasks", "rte",
                       "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "has no best/" in err and "its checkpoints: step_00000005" in err


@pytest.mark.parametrize("task,header", [("sst2", "sentence\tlabel"), ("rte", "index\tsentence1\tsentence2\tlabel")])
def test_finetune_a_modernbert_backbone(tmp_path, task, header):
    """GLUE fine-tuning of model.arch=modernbert (token types of a sentence pair are accepted and not embedded)."""
    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model

    rng = np.random.default_rng(0)
    words = "movie plot actor scene film story".split()
    rows = [header]
    for i in range(32):
        lab = i % 2
        ws = " ".join(list(rng.choice(words, 4)) + (["good"] if lab else ["bad"]))
        if task == "sst2":
            rows.append(f"{ws}\t{lab}")
        else:
            rows.append(f"{i}\t{ws}\t{' '.join(rng.choice(words, 3))}\t{'entailment' if lab else 'not_entailment'}")
    folder = {"sst2": "SST-2", "rte": "RTE"}[task]
    write(tmp_path / f"glue/{folder}/train.tsv", rows)
    write(tmp_path / f"glue/{folder}/dev.tsv", rows)
    backbone = build_model(ModelConfig(arch="modernbert", pooler=False, vocab_size=64, hidden_size=16, num_layers=3,
                                       num_heads=2, ffn_size=24, local_window=4), seed=0)
    cfg = FinetuneConfig(task=task, lr=3e-3, batch_size=8, epochs=3, seed=3, dropout=0.0)
    res = finetune(cfg, backbone, WordTokenizer(), tmp_path / "glue", log=lambda *_: None)
    assert res["steps"] == 12 and len(res["history"]) == 3
    assert res["history"][0]["loss"] > res["history"][-1]["loss"]


def test_finetune_pairs_on_a_backbone_with_one_token_type(tmp_path):
    """A BERT vocabulary ([CLS] a [SEP] b [SEP]) on a model with model.type_vocab_size=1: the pair goes in as one
    token type (type 0 throughout), as RoBERTa's does, instead of indexing a second row that is not there."""
    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model

    rows = ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\tmovie plot {('bad', 'good')[i % 2]}\tfilm story\t{('not_entailment', 'entailment')[i % 2]}"
        for i in range(16)]
    write(tmp_path / "glue/RTE/train.tsv", rows)
    write(tmp_path / "glue/RTE/dev.tsv", rows)
    backbone = build_model(ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, ffn_size=24,
                                       max_position=64, type_vocab_size=1), seed=0)
    cfg = FinetuneConfig(task="rte", lr=3e-3, batch_size=8, epochs=2, seed=3, dropout=0.0)
    res = finetune(cfg, backbone, WordTokenizer(), tmp_path / "glue", log=lambda *_: None)
    assert res["steps"] == 4 and len(res["history"]) == 2


def _tiny_bert_dir(tmp_path, words, max_position: int):
    """A to-hf export of a random tiny BERT (max_position rows) with a word-piece vocabulary of ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from pretrain.config.model import ModelConfig
    from pretrain.export.hf import export_hf
    from pretrain.model import build_model

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok.save(str(tmp_path / "tokenizer.json"))
    model = build_model(ModelConfig(vocab_size=len(vocab), hidden_size=16, num_layers=2, num_heads=2, ffn_size=32,
                                    max_position=max_position), seed=0)
    export_hf(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.mark.parametrize("backend", ["pretrain", "transformers"])
def test_max_len_past_the_position_table_is_refused_at_start(backend, tmp_path, capsys):
    """pretrain-finetune-glue --max-len above the model's position embeddings: one line naming the flag, the limit
    and what to pass, before any fine-tuning or output (not an index error, a CUDA assert, deep in the model once a
    long example comes up); --max-len at the limit runs."""
    words = "movie plot actor scene film story good bad".split()
    model = _tiny_bert_dir(tmp_path, words, max_position=16)
    rows = ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\t{' '.join(words * 2)}\tfilm story\t{('not_entailment', 'entailment')[i % 2]}" for i in range(8)]
    write(tmp_path / "glue/RTE/train.tsv", rows)
    write(tmp_path / "glue/RTE/dev.tsv", rows)
    argv = ["--model", str(model), "--backend", backend, "--tasks", "rte", "--lrs", "1e-3", "--epochs", "1",
            "--batch-size", "4", "--glue-dir", str(tmp_path / "glue"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        glue_cli.main([*argv, "--max-len", "64"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--max-len 64" in err and "16 position embeddings" in err and "pass --max-len 16 or less" in err, err
    assert not (tmp_path / "out").exists()
    glue_cli.main([*argv, "--max-len", "16"])
    assert json.loads(glue_cli.run_path(tmp_path / "out", "rte", 1e-3, 1).read_text())["steps"] == 2


def test_roberta_position_limit_leaves_out_the_rows_before_its_first_position(tmp_path):
    """RoBERTa's positions start at row pad + 1: 20 rows with pad 1 hold 18 tokens, in transformers and in ours."""
    import transformers

    from pretrain.eval.encoder import max_tokens_of
    from pretrain.eval.hf_backend import HFBackbone
    from pretrain.export.resolve import open_weights

    config = transformers.RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=20, type_vocab_size=1,
                                        pad_token_id=1, bos_token_id=0, eos_token_id=2)
    transformers.RobertaModel(config).save_pretrained(str(tmp_path))
    assert max_tokens_of(HFBackbone(tmp_path)) == 18
    assert max_tokens_of(open_weights(tmp_path).build_model(warn_fresh_head=False)) == 18
