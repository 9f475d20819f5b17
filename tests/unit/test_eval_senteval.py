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
    # SentEval's own MRPC features are the default, in the library and on the command line (what papers report)
    from pretrain.eval.cli import build_parser

    assert se.ClassifierConfig().mrpc_features == "senteval"
    assert build_parser().parse_args(["--model", "m", "--out", "o"]).mrpc_features == "senteval"


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


def _senteval_kfold_classifier(x_tr, y_tr, x_te, y_te, k, cfg):
    """SentEval's KFoldClassifier.run (tools/validation.py, sklearn path), which TREC and MRPC use: its own C grid
    2^-1 ... 2^5, stratified k-fold on train, scores rounded to 2 decimals, refit at the best C, test accuracy."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    regs = [2**t for t in range(-1, 6, 1)]
    skf = StratifiedKFold(n_splits=k, shuffle=True, random_state=cfg.seed)
    scores = []
    for reg in regs:
        fold = [LogisticRegression(C=reg, max_iter=cfg.max_iter, random_state=cfg.seed).fit(x_tr[tr], y_tr[tr])
                .score(x_tr[va], y_tr[va]) for tr, va in skf.split(x_tr, y_tr)]
        scores.append(round(100 * np.mean(fold), 2))
    optreg = regs[int(np.argmax(scores))]
    clf = LogisticRegression(C=optreg, max_iter=cfg.max_iter, random_state=cfg.seed).fit(x_tr, y_tr)
    return optreg, 100 * clf.score(x_te, y_te)


def test_train_test_c_by_kfold_uses_senteval_kfold_grid():
    """TREC/MRPC (train + test, no dev): C is chosen over SentEval's KFoldClassifier grid 2^-1..2^5, not the
    2^-2..2^3 grid of its InnerKFold/Split classifiers. Data where the reference picks C = 32."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((160, 20))
    y = (x[:, :3].sum(1) + 0.3 * rng.standard_normal(160) > 0).astype(np.int64)
    cfg = se.ClassifierConfig(kfold=4, n_jobs=1)
    ref_c, ref_acc = _senteval_kfold_classifier(x[:120], y[:120], x[120:], y[120:], 4, cfg)
    assert ref_c == 32
    got = se.train_test_accuracy(x[:120], y[:120], x[120:], y[120:], cfg)
    assert got["C"] == ref_c and got["acc"] == pytest.approx(ref_acc, abs=1e-9)


# Examples per split (MANIFEST §2; CR/MPQA keep their empty lines as SentEval does).
COUNTS = {"MR": {"all": 10662}, "CR": {"all": 3775}, "SUBJ": {"all": 10000}, "MPQA": {"all": 10606},
          "SST2": {"train": 67349, "dev": 872, "test": 1821}, "TREC": {"train": 5452, "test": 500},
          "MRPC": {"train": 4076, "test": 1725}}


def test_real_data_counts(data_dir):
    for task, splits in COUNTS.items():
        d = se.load_transfer_task(data_dir, task)
        assert {k: len(v[0]) for k, v in d.splits.items()} == splits, task
        assert {k: len(v[1]) for k, v in d.splits.items()} == splits, task


def _synthetic_senteval(root, n=60):
    """CR (nested CV) and TREC (C by k-fold, then test) with learnable signal: label words in the text."""
    rng = np.random.default_rng(3)
    words = [f"w{i}" for i in range(50)]
    r = root / "senteval"
    (r / "CR").mkdir(parents=True)
    (r / "TREC").mkdir(parents=True)
    for label, fname in ((1, "custrev.pos"), (0, "custrev.neg")):
        lines = [" ".join(rng.choice(words, 5)) + (" good" if label else " bad") * int(rng.integers(0, 3))
                 for _ in range(n)]
        (r / "CR" / fname).write_bytes("\n".join(lines).encode("latin-1"))
    for fname, m in (("train_5500.label", 3 * n), ("TREC_10.label", n)):
        lines = []
        for _ in range(m):
            c = se.TREC_CLASSES[int(rng.integers(0, 3))]
            lines.append(f"{c}:x {c.lower()} " + " ".join(rng.choice(words, 4)) + " ?")
        (r / "TREC" / fname).write_bytes("\n".join(lines).encode("latin-1"))
    return root


def _bag_of_words(calls: list):
    vocab = {w: i for i, w in enumerate([f"w{i}" for i in range(50)] + ["good", "bad", "abbr", "desc", "enty"])}

    def encode(sentences):
        calls.append(len(sentences))
        out = np.zeros((len(sentences), len(vocab)))
        for i, s in enumerate(sentences):
            for w in s.split():
                if w in vocab:
                    out[i, vocab[w]] += 1
        return out

    return encode


def test_parallel_fits_give_exactly_the_serial_results(tmp_path):
    """n_jobs only spreads the same deterministic fits over processes: nested CV, k-fold C selection and dev
    selection are bit-for-bit the serial results."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((200, 5))
    y = (x[:, 0] + rng.standard_normal(200) > 0).astype(np.int64)
    serial = se.ClassifierConfig(kfold=4, inner_kfold=3, n_jobs=1)
    parallel = se.ClassifierConfig(kfold=4, inner_kfold=3, n_jobs=2)
    assert se.nested_cv_accuracy(x, y, serial) == se.nested_cv_accuracy(x, y, parallel)
    args = (x[:120], y[:120], x[160:], y[160:])
    assert se.train_test_accuracy(*args, serial) == se.train_test_accuracy(*args, parallel)
    assert (se.train_test_accuracy(*args, serial, x_dev=x[120:160], y_dev=y[120:160])
            == se.train_test_accuracy(*args, parallel, x_dev=x[120:160], y_dev=y[120:160]))
    with pytest.raises(ValueError, match="n_jobs"):
        se.ClassifierConfig(n_jobs=-1)


def test_transfer_writes_each_task_as_it_finishes_and_resumes(tmp_path):
    data = _synthetic_senteval(tmp_path)
    cfg = se.ClassifierConfig(kfold=3, inner_kfold=2, n_jobs=1)
    path = tmp_path / "out" / "transfer_partial.json"
    lines, calls = [], []
    key = {"model": "m1", "pooling": "cls"}
    first = se.evaluate_transfer(_bag_of_words(calls), data, ("CR", "TREC"), cfg, log=lines.append,
                                 results_path=path, resume_key=key)
    assert first["CR"]["acc"] > 60 and first["TREC"]["acc"] > 60
    assert any("CR (1/2)" in ln for ln in lines) and any("TREC (2/2)" in ln for ln in lines)
    assert sorted(__import__("json").loads(path.read_text())["tasks"]) == ["CR", "TREC"]
    # Resumed: nothing is encoded or fitted again and the figures are the same.
    calls.clear()
    lines.clear()
    again = se.evaluate_transfer(_bag_of_words(calls), data, ("CR", "TREC"), cfg, log=lines.append,
                                 results_path=path, resume_key=key)
    assert again == first and calls == [] and all("resumed from" in ln for ln in lines)
    # Another model (or classifier setting) starts over; an unreadable file is ignored with a note.
    se.evaluate_transfer(_bag_of_words(calls), data, ("CR",), cfg, log=lines.append, results_path=path,
                         resume_key={"model": "m2", "pooling": "cls"})
    assert calls and any("starting over" in ln for ln in lines)
    path.write_text('{"key": ')
    lines.clear()
    se.evaluate_transfer(_bag_of_words(calls), data, ("CR",), cfg, log=lines.append, results_path=path,
                         resume_key=key)
    assert any("ignoring unreadable" in ln for ln in lines)
