"""Supervised SimCSE: data.pairs rows (tsv/csv/jsonl, bad rows named by file and line), their samples and batches,
and InfoNCE/ArcCon with hard negatives against a float64 reference of SimCSE's loss with its weight alpha."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch

from pretrain.config.data import DataConfig
from pretrain.config.objective import InfoNCEConfig, ObjectiveConfig
from pretrain.data.pairs import read_pairs
from pretrain.data.sentences import PairDataset, build_sentence_dataset, collate_sentences
from pretrain.losses.arccon import arccon
from pretrain.losses.info_nce import info_nce

# ----------------------------------------------------------------------------- the loss


def simcse_reference(q, k, neg, pos, *, temperature, alpha, margin=0.0):
    """SimCSE eq. 5 with App. D's alpha, written out in float64 over the materialised N x 2M logits."""
    q, k, neg = (torch.nn.functional.normalize(x.double(), dim=-1) for x in (q, k, neg))
    s, h = q @ k.T, q @ neg.T
    total = 0.0
    for i in range(q.shape[0]):
        p = int(pos[i])
        c = s[i, p].clamp(-1, 1)
        top = math.exp(math.cos(math.acos(float(c)) + margin) / temperature)
        denom = top + sum(math.exp(float(s[i, j]) / temperature) for j in range(k.shape[0]) if j != p)
        denom += sum((alpha if j == p else 1.0) * math.exp(float(h[i, j]) / temperature) for j in range(k.shape[0]))
        total += -math.log(top / denom)
    return total


@pytest.mark.parametrize("impl", ["eager", "torch"])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0, 0.0])
def test_info_nce_with_hard_negatives_matches_simcse_reference(impl, alpha):
    g = torch.Generator().manual_seed(0)
    q, k, neg = (torch.randn(6, 8, generator=g) for _ in range(3))
    k2 = torch.cat([k, torch.randn(4, 8, generator=g)])  # keys of another rank too: M = 10 > N
    neg2 = torch.cat([neg, torch.randn(4, 8, generator=g)])
    pos = torch.arange(6) + 2  # rows at an offset, as gathered
    k2 = torch.roll(k2, 2, 0)
    neg2 = torch.roll(neg2, 2, 0)
    loss, count, metrics = info_nce(q, k2, pos, temperature=0.05, impl=impl, chunk_size=3, neg_MD=neg2,
                                    neg_weight=alpha)
    assert count == 6
    assert float(loss) == pytest.approx(simcse_reference(q, k2, neg2, pos, temperature=0.05, alpha=alpha), rel=2e-5)
    assert "hard_neg_cos" in metrics


def test_hard_negatives_make_the_loss_larger_and_get_gradient():
    g = torch.Generator().manual_seed(1)
    q, k, neg = (torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = torch.arange(5)
    plain, _, _ = info_nce(q, k, pos, temperature=0.05)
    hard, _, _ = info_nce(q, k, pos, temperature=0.05, neg_MD=neg, neg_weight=2.0)
    assert float(hard.detach()) > float(plain.detach())
    hard.backward()
    assert float(neg.grad.abs().sum()) > 0
    torch.autograd.gradcheck(lambda a, b, c: info_nce(a, b, pos, temperature=0.5, neg_MD=c, neg_weight=0.7)[0],
                             (q.detach().requires_grad_(), k.detach().requires_grad_(), neg.detach().requires_grad_()))


def test_arccon_with_hard_negatives_matches_reference():
    g = torch.Generator().manual_seed(2)
    q, k, neg = (torch.randn(4, 8, generator=g) for _ in range(3))
    pos = torch.arange(4)
    loss, _, _ = arccon(q, k, pos, temperature=0.05, margin_deg=10.0, impl="torch", chunk_size=3, neg_MD=neg,
                        neg_weight=1.5)
    want = simcse_reference(q, k, neg, pos, temperature=0.05, alpha=1.5, margin=math.radians(10.0))
    assert float(loss) == pytest.approx(want, rel=2e-5)


def test_hard_negative_weight_is_checked():
    with pytest.raises(ValueError, match="objective.info_nce.hard_negative_weight must be >= 0"):
        InfoNCEConfig(hard_negative_weight=-1.0)


# ----------------------------------------------------------------------------- reading rows


def test_tsv_with_header_csv_with_quotes_and_jsonl(tmp_path):
    tsv = tmp_path / "nli.tsv"
    tsv.write_text("sent0\tsent1\thard_neg\nA man sleeps.\tA person rests.\tA man runs.\n\n"
                   "Two dogs.\tAnimals.\tNo dogs.\n", encoding="utf-8")
    rows = read_pairs(str(tsv))
    assert rows.anchor == ["A man sleeps.", "Two dogs."] and rows.negative == ["A man runs.", "No dogs."]
    csv_path = tmp_path / "nli_for_simcse.csv"
    csv_path.write_text('sent0,sent1,hard_neg\n"Hi, there","say ""hi""",bye\n"multi\nline",b,c\n', encoding="utf-8")
    rows = read_pairs(str(csv_path))
    assert rows.anchor == ["Hi, there", "multi\nline"] and rows.positive == ['say "hi"', "b"]
    jsonl = tmp_path / "pairs.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"anchor": "a", "positive": "b"}) + "\n" + json.dumps(["c", "d"]) + "\n")
    rows = read_pairs(str(jsonl))
    assert rows.anchor == ["a", "c"] and rows.positive == ["b", "d"] and rows.negative is None


@pytest.mark.parametrize("name", ["nli.csv", "nli.tsv", "nli.csv.gz"])
def test_a_byte_order_mark_before_the_header_is_not_read_as_a_pair(tmp_path, name):
    """A UTF-8 BOM (Excel's CSV export, Notepad) is no text: the header after it is still a header, not a training
    pair ['\\ufeffsent0', 'sent1', 'hard_neg'], as the preprocessing readers drop a file's BOM."""
    sep = "\t" if ".tsv" in name else ","
    text = f"sent0{sep}sent1{sep}hard_neg\nA man sleeps.{sep}A person rests.{sep}A man runs.\n"
    raw = b"\xef\xbb\xbf" + text.encode("utf-8")
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    rows = read_pairs(str(tmp_path / name))
    assert rows.anchor == ["A man sleeps."] and rows.positive == ["A person rests."]
    assert rows.negative == ["A man runs."]


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    """data.sentences: a file's BOM is dropped, so its first sentence is the same as without it."""
    path = tmp_path / "s.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst sentence.\nSecond sentence.\n")
    cfg = DataConfig(stage="sentences", sentences=str(path), view_max_len=8)
    ds = build_sentence_dataset(cfg, ObjectiveConfig(mlm=None), WordTokenizer(), seed=0)
    assert ds.lines == ["First sentence.", "Second sentence."]


@pytest.mark.parametrize("name,text,match", [
    ("p.tsv", "a\tb\tc\nd\te\tf\ng\th\n", r"p.tsv:3: 2 columns, but the first row has 3"),
    ("p.tsv", "a\tb\nonly one field\n", r"p.tsv:2: expected 2 or 3 columns .*got 1"),
    ("p.tsv", "a\tb\n\na\tb\tc\td\n", r"p.tsv:3: expected 2 or 3 columns .*got 4"),
    ("p.tsv", "a\t \n", r"p.tsv:1: the positive is empty"),
    ("p.csv", "a,b\nc,\n", r"p.csv:2: the positive is empty"),
    ("p.jsonl", '{"anchor": "a", "positive": "b"}\n{"anchor": "a"\n', r"p.jsonl:2: not valid JSON"),
    ("p.jsonl", '{"anchor": "a", "pos": "b"}\n', r"p.jsonl:1: the object has no 'positive' key"),
    ("p.jsonl", '["a", 3]\n', r"p.jsonl:1: expected an object"),
    ("p.txt", "a\tb\n", r"cannot tell the format"),
    ("p.tsv", "\n\n", r"holds no rows"),
])
def test_bad_rows_name_file_and_line(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        read_pairs(str(path))


def test_missing_file_and_both_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.pairs="):
        read_pairs(str(tmp_path / "none.tsv"))
    with pytest.raises(ValueError, match="both set"):
        DataConfig(stage="sentences", sentences="a.txt", pairs="b.tsv")
    assert DataConfig(stage="sentences", pairs="b.tsv").pairs == "b.tsv"


# ----------------------------------------------------------------------------- samples and batches


class WordTokenizer:
    """Whitespace words -> ids (enough for the dataset: encode, specials, vocab size)."""

    cls_id, sep_id, mask_id, pad_id = 1, 2, 3, 0
    special_ids = frozenset({0, 1, 2, 3})
    vocab_size = 100

    def encode(self, text: str) -> list[int]:
        return [4 + sum(map(ord, w)) % 96 for w in text.split()]


def test_pair_dataset_samples_and_collate(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("a b c\td e\tf g h i\nj\tk l m n o p q r s t u v w\tx\n", encoding="utf-8")
    cfg = DataConfig(stage="sentences", pairs=str(path), view_max_len=8)
    objective = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig())
    ds = build_sentence_dataset(cfg, objective, WordTokenizer(), seed=0)
    assert isinstance(ds, PairDataset) and len(ds) == 2 and ds.has_negatives
    s = ds[(0, 3)]  # index 3 -> row 1
    tok = WordTokenizer()
    np.testing.assert_array_equal(s["sentence"], [1, *tok.encode("j"), 2])
    assert len(s["positive"]) == 8 and s["positive"][0] == 1 and s["positive"][-1] == 2  # cut to view_max_len
    batch = collate_sentences([ds[0], ds[1]], pad_id=0)
    assert batch["positive_ids"].shape == (2, 8) and batch["negative_ids"].shape == (2, 6)
    assert batch["negative_mask"].sum(1).tolist() == [6, 3]
    assert torch.equal(batch["input_ids"], batch["sentence_ids"])
