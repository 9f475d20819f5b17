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
    cr = se.load_transfer_task(se_dir, "CR").splits["all"]  # SentEval's order: (words, label)
    assert cr[0] == ["", "bad battery", "love it", "great phone !"] and list(cr[1]) == [1, 0, 1, 1]
    trec = se.load_transfer_task(se_dir, "TREC").splits
    assert trec["train"][0] == ["Who is he ?", "When was caf\xe9 opened ?"]
    assert list(trec["train"][1]) == [se.TREC_CLASSES.index("HUM"), se.TREC_CLASSES.index("NUM")]
    sst = se.load_transfer_task(se_dir, "SST2").splits
    assert sst["dev"][0] == ["no good", "a fine film"] and list(sst["test"][1]) == [0, 1]
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


def test_inner_kfold_sets_the_folds_that_choose_c_for_trec_and_mrpc_too():
    """--inner-kfold (the model selection's folds) reached the InnerKFold tasks only: TREC's and MRPC's C was
    chosen by 10-fold CV on train whatever it said (70 fits for MRPC: most of a quick transfer run). Left unset it
    is kfold, as SentEval."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((160, 20))
    y = (x[:, :3].sum(1) + 0.8 * rng.standard_normal(160) > 0).astype(np.int64)
    for k in (2, 3, 4):
        cfg = se.ClassifierConfig(kfold=4, inner_kfold=k, n_jobs=1)
        ref_c, ref_acc = _senteval_kfold_classifier(x[:120], y[:120], x[120:], y[120:], k, cfg)
        got = se.train_test_accuracy(x[:120], y[:120], x[120:], y[120:], cfg)
        assert got["C"] == ref_c and got["acc"] == pytest.approx(ref_acc, abs=1e-9), k
    assert se.ClassifierConfig(kfold=4).inner_kfold == 4


# Examples per split (MANIFEST §2; CR/MPQA keep their empty lines as SentEval does).
COUNTS = {"MR": {"all": 10662}, "CR": {"all": 3775}, "SUBJ": {"all": 10000}, "MPQA": {"all": 10606},
          "SST2": {"train": 67349, "dev": 872, "test": 1821}, "TREC": {"train": 5452, "test": 500},
          "MRPC": {"train": 4076, "test": 1725}}


def test_real_data_counts(data_dir):
    for task, splits in COUNTS.items():
        d = se.load_transfer_task(data_dir, task)
        assert {k: len(v[0]) for k, v in d.splits.items()} == splits, task
        assert {k: len(v[1]) for k, v in d.splits.items()} == splits, task


def _senteval_reference(root, task):
    """Each split as SentEval's own classes hand it to the classifier (binary.py, sst.py, trec.py, mrpc.py): token
    lists read their way, labelled their way (SUBJ: objective = 1, MRPC: the Quality column), sorted by their key."""
    r = root / "senteval"

    def lines(path, enc):
        with open(path, encoding=enc) as f:
            return f.read().splitlines()

    def srt(rows, key):
        return [(" ".join(t[0]) if not isinstance(t[0], tuple) else tuple(" ".join(w) for w in t[0]), t[1])
                for t in sorted(rows, key=key)]

    files = {"MR": ("MR/rt-polarity.pos", "MR/rt-polarity.neg"), "CR": ("CR/custrev.pos", "CR/custrev.neg"),
             "SUBJ": ("SUBJ/subj.objective", "SUBJ/subj.subjective"), "MPQA": ("MPQA/mpqa.pos", "MPQA/mpqa.neg")}
    if task in files:
        pos, neg = ([ln.split() for ln in lines(r / f, "latin-1")] for f in files[task])
        return {"all": srt([(s, 1) for s in pos] + [(s, 0) for s in neg], lambda z: (len(z[0]), z[1]))}
    if task == "SST2":
        return {split: srt([(ln.strip().split("\t")[0].split(), int(ln.strip().split("\t")[1]))
                            for ln in lines(r / f"SST/binary/sentiment-{split}", "utf-8")
                            if len(ln.strip().split("\t")) == 2], lambda z: (len(z[0]), z[1]))
                for split in ("train", "dev", "test")}
    if task == "TREC":
        tgt = {c: i for i, c in enumerate(("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"))}
        out = {}
        for split, fname in (("train", "train_5500.label"), ("test", "TREC_10.label")):
            rows = [(ln.strip().split(":", 1)[1].split(" ", 1)[1].split(), tgt[ln.strip().split(":", 1)[0]])
                    for ln in lines(r / "TREC" / fname, "latin-1") if ln.strip()]
            out[split] = srt(rows, lambda z: (len(z[0]), z[1]))
        return out
    out = {}
    for split in ("train", "test"):
        rows = [ln.strip().split("\t") for ln in lines(r / f"MRPC/msr_paraphrase_{split}.txt", "utf-8")[1:]
                if ln.strip()]
        rows = [((t[3].split(), t[4].split()), int(t[0])) for t in rows]
        out[split] = srt(rows, lambda z: (len(z[0][0]), len(z[0][1]), z[1]))
    return out


def test_real_data_in_senteval_order(data_dir):
    """The classifier sees each split in the order (and with the labels) SentEval's tasks give it: its k-fold
    selections draw their folds over that order, so only then are the folds SentEval's."""
    for task in se.TASKS:
        ref = _senteval_reference(data_dir, task)
        got = se.load_transfer_task(data_dir, task).splits
        assert set(got) == set(ref), task
        for split, rows in ref.items():
            assert list(zip(got[split][0], got[split][1].tolist())) == rows, (task, split)


def test_senteval_folds_from_the_same_embeddings():
    """Nested CV over embeddings in SentEval's order equals SentEval's InnerKFoldClassifier (sklearn path, default
    max_iter) run on them; over the file order the folds, and here the accuracy, differ."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    rng = np.random.default_rng(5)
    sents = [" ".join(["w"] * int(n)) + f" s{i}" for i, n in enumerate(rng.integers(1, 9, 120))]
    y = rng.integers(0, 2, 120)
    emb = {s: rng.standard_normal(4) + 0.8 * lab for s, lab in zip(sents, y)}
    data = se.senteval_order(se.TransferData(splits={"all": (sents, y)}))
    x_sorted, y_sorted = np.stack([emb[s] for s in data.splits["all"][0]]), data.splits["all"][1]
    cfg = se.ClassifierConfig(kfold=3, inner_kfold=3, n_jobs=1)
    regs, accs = [2.0**t for t in range(-2, 4)], []
    for tr, te in StratifiedKFold(n_splits=3, shuffle=True, random_state=1111).split(x_sorted, y_sorted):
        inner = StratifiedKFold(n_splits=3, shuffle=True, random_state=1111)
        scores = [np.mean([LogisticRegression(C=c, random_state=1111).fit(x_sorted[tr][a], y_sorted[tr][a])
                           .score(x_sorted[tr][b], y_sorted[tr][b]) for a, b in inner.split(x_sorted[tr],
                                                                                          y_sorted[tr])])
                  for c in regs]
        clf = LogisticRegression(C=regs[int(np.argmax(scores))], random_state=1111).fit(x_sorted[tr], y_sorted[tr])
        accs.append(clf.score(x_sorted[te], y_sorted[te]))
    assert se.nested_cv_accuracy(x_sorted, y_sorted, cfg)["acc"] == pytest.approx(100 * np.mean(accs), abs=1e-9)
    x_file = np.stack([emb[s] for s in sents])
    assert se.nested_cv_accuracy(x_file, y, cfg)["acc"] != pytest.approx(100 * np.mean(accs), abs=1e-9)


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
