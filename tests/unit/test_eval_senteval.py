"""SentEval transfer: readers on fixtures / real counts, nested CV vs sklearn's GridSearchCV reference."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.eval import senteval as se


@pytest.fixture
def se_dir(tmp_path):
    r = tmp_path / "senteval"
    for d in ("CR", "TREC", "SST/binary", "MRPC"):
        (r / d).mkdir(parents=True)
    (r / "CR/custrev.pos").write_bytes("great phone !\n\nlove it\n".encode("latin-1"))
    (r / "CR/custrev.neg").write_bytes("bad  battery\n".encode("latin-1"))
    (r / "TREC/train_5500.label").write_bytes("NUM:date When was caf\xe9 opened ?\nHUM:ind Who is he ?\n"
                                              .encode("latin-1"))
    (r / "TREC/TREC_10.label").write_bytes("LOC:city Where is Paris ?\n".encode("latin-1"))
    for split in ("train", "dev", "test"):
        (r / f"SST/binary/sentiment-{split}").write_text("a fine film \t1\nno good \t0\n", encoding="utf-8")
    hdr = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    for split in ("train", "test"):
        (r / f"MRPC/msr_paraphrase_{split}.txt").write_text(hdr + "1\t1\t2\tHe said \" yes .\tHe agreed .\n",
                                                              encoding="utf-8")
    return tmp_path


def test_readers(se_dir):
    cr = se.load_transfer_task(se_dir, "CR").splits["all"]
    assert cr[0] == ["great phone !", "", "love it", "bad battery"] and list(cr[1]) == [1, 1, 1, 0]
    trec = se.load_transfer_task(se_dir, "TREC").splits
    assert trec["train"][0] == ["When was caf\xe9 opened ?", "Who is he ?"]
    assert list(trec["train"][1]) == [se.TREC_CLASSES.index("NUM"), se.TREC_CLASSES.index("HUM")]
    sst = se.load_transfer_task(se_dir, "SST2").splits
    assert sst["dev"][0] == ["a fine film", "no good"] and list(sst["test"][1]) == [1, 0]
    mrpc = se.load_transfer_task(se_dir, "MRPC")
    assert mrpc.pairs and mrpc.splits["train"][0] == [('He said " yes .', "He agreed .")]
    with pytest.raises(ValueError):
        se.load_transfer_task(se_dir, "SICK-E")


def test_pair_features():
    u, v = np.array([[1.0, 2.0]]), np.array([[3.0, -1.0]])
    np.testing.assert_array_equal(se.pair_features(u, v, "uv_absdiff_prod"), [[1, 2, 3, -1, 2, 3, 3, -2]])
    np.testing.assert_array_equal(se.pair_features(u, v, "senteval"), [[2, 3, 3, -2]])


def test_nested_cv_matches_sklearn_reference():
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, StratifiedKFold, cross_val_score

    rng = np.random.default_rng(0)
    x = rng.standard_normal((240, 6))
    y = (x[:, 0] + 0.8 * rng.standard_normal(240) > 0).astype(np.int64)
    cfg = se.ClassifierConfig(kfold=4, inner_kfold=3, c_grid=(0.01, 0.1, 1.0))
    got = se.nested_cv_accuracy(x, y, cfg)
    inner = StratifiedKFold(3, shuffle=True, random_state=cfg.seed)
    outer = StratifiedKFold(4, shuffle=True, random_state=cfg.seed)
    search = GridSearchCV(LogisticRegression(max_iter=cfg.max_iter, random_state=cfg.seed),
                          {"C": list(cfg.c_grid)}, cv=inner)
    ref = 100 * cross_val_score(search, x, y, cv=outer).mean()
    assert got["acc"] == pytest.approx(ref, abs=1e-9)
    assert 60 < got["acc"] < 95
    # train/test with dev selection picks the dev-best C
    res = se.train_test_accuracy(x[:150], y[:150], x[200:], y[200:], cfg, x_dev=x[150:200], y_dev=y[150:200])
    dev_scores = [LogisticRegression(C=c, max_iter=cfg.max_iter, random_state=cfg.seed).fit(x[:150], y[:150])
                  .score(x[150:200], y[150:200]) for c in cfg.c_grid]
    assert res["C"] == cfg.c_grid[int(np.argmax(dev_scores))]


# Examples per split (MANIFEST §2; CR/MPQA keep their empty lines as SentEval does).
COUNTS = {"MR": {"all": 10662}, "CR": {"all": 3775}, "SUBJ": {"all": 10000}, "MPQA": {"all": 10606},
          "SST2": {"train": 67349, "dev": 872, "test": 1821}, "TREC": {"train": 5452, "test": 500},
          "MRPC": {"train": 4076, "test": 1725}}


def test_real_data_counts(data_dir):
    for task, splits in COUNTS.items():
        d = se.load_transfer_task(data_dir, task)
        assert {k: len(v[0]) for k, v in d.splits.items()} == splits, task
        assert {k: len(v[1]) for k, v in d.splits.items()} == splits, task
