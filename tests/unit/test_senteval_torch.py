"""SentEval's PyTorch classifier path: the early-stopping rule on scripted dev accuracies, one fit against a plain
float64 Adam/RMSprop loop, the three selections against plain re-implementations of validation.py, and TREC end to
end under pytorch-fasttest against the scikit-learn path on the same features."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pretrain.eval import senteval as se
from pretrain.eval import senteval_torch as st
from pretrain.eval import transfer_setup as ts

SEED = 1111


class Scripted(st.LogReg):
    """A LogReg whose dev accuracy after each round comes from a script; records the weights each round saw."""

    def __init__(self, accs, *args, **kw):
        super().__init__(*args, **kw)
        self.accs, self.seen, self.epochs = list(accs), [], 0

    def train_epochs(self, x, y):
        super().train_epochs(x, y)
        self.epochs += self.cfg.epoch_size

    def dev_accuracy(self, x, y):
        self.seen.append(self.model.weight.detach().clone())
        return self.accs[len(self.seen) - 1]


def _problem(n=120, dim=8, classes=3, seed=0, noise=0.3):
    rng = np.random.default_rng(seed)
    centers = 2 * rng.standard_normal((classes, dim))
    y = rng.integers(0, classes, n)
    return (centers[y] + noise * rng.standard_normal((n, dim))).astype(np.float32), y.astype(np.int64)


@pytest.mark.parametrize("tenacity, epoch_size, max_epoch, accs, rounds, kept", [
    # a tie is no improvement; the 3rd miss stops (checked >= tenacity before counting it)
    (2, 1, 200, [.5, .7, .6, .7, .65, .9, .9], 5, 1),
    # the count is never reset by an improvement: misses in rounds 2, 4, 6 -> stop in round 6
    (2, 1, 200, [.5, .4, .6, .5, .7, .6, .9, .95, .97], 6, 4),
    (0, 1, 200, [.5, .5, .9], 2, 0),
    # always improving: rounds start while nepoch <= max_epoch (0, 4, 8), i.e. 12 epochs
    (5, 4, 10, [.1, .2, .3, .4, .5], 3, 2),
    (5, 4, 8, [.1, .2, .3, .4, .5], 3, 2),
])
def test_early_stopping_rule(tenacity, epoch_size, max_epoch, accs, rounds, kept):
    x, y = _problem()
    cfg = ts.TorchClassifierConfig(optim="adam", batch_size=16, tenacity=tenacity, epoch_size=epoch_size,
                                   max_epoch=max_epoch)
    clf = Scripted(accs, x.shape[1], 3, 1e-3, cfg, SEED)
    best = clf.fit(x[:90], y[:90], validation_data=(x[90:], y[90:]))
    assert len(clf.seen) == rounds and clf.epochs == clf.nepoch == rounds * epoch_size
    assert best == accs[kept]
    torch.testing.assert_close(clf.model.weight, clf.seen[kept], rtol=0, atol=0)  # the best round's model is kept
    assert not torch.equal(clf.seen[kept], clf.seen[-1]) or kept == rounds - 1


def _reference_fit(x, y, optim, l2reg, epochs, batch_size, split=None, seed=SEED):
    """The same mini-batch loop written plainly in float64 numpy: nn.Linear's init after torch.manual_seed, numpy's
    permutations after np.random.seed, softmax cross-entropy (batch mean) gradients, coupled L2, Adam/RMSprop."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(x.shape[1], 3)
    w, b = lin.weight.detach().double().numpy().copy(), lin.bias.detach().double().numpy().copy()
    params = [w, b]
    state = [dict(m=np.zeros_like(p), v=np.zeros_like(p)) for p in params]
    np.random.seed(seed)
    x, y = x.astype(np.float64), y
    if split is not None:
        perm = np.random.permutation(len(x))
        x, y = x[perm[int(split * len(x)):]], y[perm[int(split * len(x)):]]
    t = 0
    for _ in range(epochs):
        perm = np.random.permutation(len(x))
        for i in range(0, len(x), batch_size):
            xb, yb = x[perm[i:i + batch_size]], y[perm[i:i + batch_size]]
            z = xb @ w.T + b
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(len(yb)), yb] -= 1
            g = p / len(yb)
            t += 1
            for param, grad, s in zip(params, [g.T @ xb, g.sum(0)], state):
                grad = grad + l2reg * param
                if optim == "adam":
                    s["m"] = 0.9 * s["m"] + 0.1 * grad
                    s["v"] = 0.999 * s["v"] + 0.001 * grad**2
                    mhat, vhat = s["m"] / (1 - 0.9**t), s["v"] / (1 - 0.999**t)
                    param -= 1e-3 * mhat / (np.sqrt(vhat) + 1e-8)
                else:
                    s["v"] = 0.99 * s["v"] + 0.01 * grad**2
                    param -= 1e-2 * grad / (np.sqrt(s["v"]) + 1e-8)
    return w, b


@pytest.mark.parametrize("optim", ["adam", "rmsprop"])
@pytest.mark.parametrize("split", [None, 0.1])
def test_one_fit_matches_a_plain_float64_loop(optim, split):
    """Dev accuracy scripted to rise every round, so the last model is kept: 4 rounds x 2 epochs, compared with the
    float64 loop (same seeds, same permutations; with validation_split the held-out rows come first)."""
    x, y = _problem(noise=1.0)
    cfg = ts.TorchClassifierConfig(optim=optim, batch_size=16, epoch_size=2, max_epoch=6)
    np_state, torch_state = np.random.get_state()[1].copy(), torch.random.get_rng_state()
    clf = Scripted([.1, .2, .3, .4], x.shape[1], 3, 0.05, cfg, SEED)
    if split is None:
        clf.fit(x, y, validation_data=(x[:10], y[:10]))
    else:
        clf.fit(x, y, validation_split=split)
    # the process's generators are left alone (SentEval reseeds them; here private ones give the same numbers)
    assert np.array_equal(np.random.get_state()[1], np_state) and torch.equal(torch.random.get_rng_state(),
                                                                              torch_state)
    w, b = _reference_fit(x, y, optim, 0.05, 8, 16, split)
    w0, _ = _reference_fit(x, y, optim, 0.05, 0, 16, split)
    w_no_l2, _ = _reference_fit(x, y, optim, 0.0, 8, 16, split)
    got_w, got_b = clf.model.weight.detach().double().numpy(), clf.model.bias.detach().double().numpy()
    assert np.abs(w - w0).max() > 0.02  # it trained
    assert np.abs(w - w_no_l2).max() > 1e-3  # the coupled L2 matters at this size
    np.testing.assert_allclose(got_w, w, atol=2e-5)
    np.testing.assert_allclose(got_b, b, atol=2e-5)


def test_a_real_fit_learns_and_scores_like_its_predictions():
    x, y = _problem(n=300, noise=0.8)
    cfg = ts.TorchClassifierConfig(optim="adam", batch_size=64, tenacity=5, epoch_size=4)
    clf = st.LogReg(x.shape[1], 3, 1e-4, cfg, SEED)
    best = clf.fit(x[:200], y[:200], validation_data=(x[200:250], y[200:250]))
    assert best == clf.score(x[200:250], y[200:250]) > 0.8
    assert clf.score(x[250:], y[250:]) == np.mean(clf.predict(x[250:]) == y[250:]) > 0.8
    again = st.LogReg(x.shape[1], 3, 1e-4, cfg, SEED)
    assert again.fit(x[:200], y[:200], validation_data=(x[200:250], y[200:250])) == best
    torch.testing.assert_close(again.model.weight, clf.model.weight, rtol=0, atol=0)  # run to run: the same


# --- the three selections against plain re-implementations of SentEval's validation.py (PyTorch path) ---------

def _cfg(n_jobs=1, **kw):
    torch_cfg = ts.TorchClassifierConfig(optim="rmsprop", batch_size=32, tenacity=1, epoch_size=1, max_epoch=5,
                                         l2_grid=(1e-4, 0.3, 1.0, 3.0))
    return se.ClassifierConfig(backend="pytorch", pytorch=torch_cfg, n_jobs=n_jobs, **kw)


def _clf(x, nclasses, reg, cfg):
    return st.LogReg(x.shape[1], nclasses, reg, cfg.pytorch, SEED)


def _binary(n=240, dim=8, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] + rng.standard_normal(n) > 0).astype(np.int64)


def _ref_inner_kfold(x, y, k, cfg):
    from sklearn.model_selection import StratifiedKFold

    regs, dev, test, all_scores = cfg.pytorch.l2_grid, [], [], []
    for tr, te in StratifiedKFold(n_splits=k, shuffle=True, random_state=1111).split(x, y):
        xt, yt = x[tr], y[tr]
        scores = []
        for reg in regs:
            accs = []
            for a, b in StratifiedKFold(n_splits=k, shuffle=True, random_state=1111).split(xt, yt):
                clf = _clf(x, 2, reg, cfg)
                clf.fit(xt[a], yt[a], validation_data=(xt[b], yt[b]))
                accs.append(clf.score(xt[b], yt[b]))
            scores.append(round(100 * np.mean(accs), 2))
        all_scores.append(scores)
        dev.append(np.max(scores))
        clf = _clf(x, 2, regs[int(np.argmax(scores))], cfg)
        clf.fit(xt, yt, validation_split=0.05)
        test.append(round(100 * clf.score(x[te], y[te]), 2))
    return round(np.mean(dev), 2), round(np.mean(test), 2), all_scores


def test_inner_kfold_matches_validation_py():
    x, y = _binary()
    cfg = _cfg(kfold=3, inner_kfold=3)
    dev, test, scores = _ref_inner_kfold(x, y, 3, cfg)
    assert any(len(set(s)) > 2 for s in scores)  # the grid matters here: the pick is tested
    got = st.inner_kfold_accuracy(x, y, cfg, 2)
    assert got == {"acc": test, "devacc": dev, "n": len(y)}


def _ref_kfold(x, y, xt, yt, k, nclasses, cfg):
    from sklearn.model_selection import StratifiedKFold

    regs, scores = cfg.pytorch.l2_grid, []
    for reg in regs:
        accs = []
        for a, b in StratifiedKFold(n_splits=k, shuffle=True, random_state=cfg.seed).split(x, y):
            clf = _clf(x, nclasses, reg, cfg)
            clf.fit(x[a], y[a], validation_data=(x[b], y[b]))
            accs.append(clf.score(x[b], y[b]))
        scores.append(round(100 * np.mean(accs), 2))
    clf = _clf(x, nclasses, regs[int(np.argmax(scores))], cfg)
    clf.fit(x, y, validation_split=0.05)
    return np.max(scores), round(100 * clf.score(xt, yt), 2), regs[int(np.argmax(scores))], scores


def test_kfold_matches_validation_py_and_does_not_depend_on_jobs():
    x, y = _problem(n=300, noise=2.0, seed=4)
    cfg = _cfg(kfold=4)
    dev, test, reg, scores = _ref_kfold(x[:220], y[:220], x[220:], y[220:], 4, 3, cfg)
    assert scores.index(max(scores)) > 0 and scores.count(max(scores)) > 1  # the pick: the first of a tie
    got = st.kfold_accuracy(x[:220], y[:220], x[220:], y[220:], cfg, 3)
    assert got == {"acc": test, "devacc": dev, "l2reg": reg, "n": 80}
    from joblib.externals.loky import get_reusable_executor

    try:  # the fits spread over 2 worker processes: the same numbers
        assert st.kfold_accuracy(x[:220], y[:220], x[220:], y[220:], _cfg(kfold=4, n_jobs=2), 3) == got
    finally:
        get_reusable_executor().shutdown(wait=True)  # no idle workers left behind for the next tests


def test_split_matches_validation_py():
    x, y = _binary(n=300, seed=10)
    cfg = _cfg()
    regs, scores = cfg.pytorch.l2_grid, []
    for reg in regs:
        clf = _clf(x, 2, reg, cfg)
        clf.fit(x[:150], y[:150], validation_data=(x[150:220], y[150:220]))
        scores.append(round(100 * clf.score(x[150:220], y[150:220]), 2))
    assert scores.index(max(scores)) > 0 and scores.count(max(scores)) > 1  # the pick: the first of a tie
    opt = regs[int(np.argmax(scores))]
    clf = _clf(x, 2, opt, cfg)  # SentEval refits at the chosen strength
    clf.fit(x[:150], y[:150], validation_data=(x[150:220], y[150:220]))
    pred = clf.predict(x[220:])
    tp = np.sum((pred == 1) & (y[220:] == 1))
    f1 = round(100 * 2 * tp / (2 * tp + np.sum(pred != y[220:])), 2)
    got = st.split_accuracy(x[:150], y[:150], x[150:220], y[150:220], x[220:], y[220:], cfg, 2)
    assert got == {"acc": round(100 * clf.score(x[220:], y[220:]), 2), "devacc": np.max(scores), "l2reg": opt,
                   "n": 80, "f1": pytest.approx(f1, abs=1e-12)}


def test_the_pick_rounds_a_fold_mean_as_numpy_does():
    """validation.py rounds ``100 * np.mean(accs)`` (numpy float64: numpy's rounding) but ``100 * clf.score(...)``
    (a float: Python's); they differ on some values, e.g. 70.895 (numpy 70.9, Python 70.89)."""
    assert round(100 * np.float64(0.70895), 2) == 70.9 and round(100 * 0.70895, 2) == 70.89
    assert se.senteval_best((1, 2), [np.mean([0.70895]), 0.709]) == (1, pytest.approx(0.709))  # a tie: the first
    assert se.senteval_best((1, 2), [0.70895, 0.709]) == (2, pytest.approx(0.709))


def test_presets_and_the_resume_key():
    from pretrain.eval.cli import build_parser

    args = build_parser().parse_args(["--model", "m", "--transfer-classifier", "pytorch-fasttest"])
    fast = ts.transfer_classifier(args.transfer_classifier, inner_kfold=args.inner_kfold)
    assert (fast.backend, fast.kfold, fast.inner_kfold) == ("pytorch", 5, 5)
    assert (fast.pytorch.optim, fast.pytorch.batch_size, fast.pytorch.tenacity, fast.pytorch.epoch_size) == (
        "rmsprop", 32, 3, 2)
    test = ts.transfer_classifier("pytorch-test")
    assert (test.kfold, test.inner_kfold, test.pytorch.optim, test.pytorch.batch_size, test.pytorch.tenacity,
            test.pytorch.epoch_size, test.pytorch.max_epoch) == (10, 10, "adam", 64, 5, 4, 200)
    assert test.pytorch.l2_grid == (1e-5, 1e-4, 1e-3, 1e-2)
    default = build_parser().parse_args(["--model", "m"])
    sk = ts.transfer_classifier(default.transfer_classifier, inner_kfold=default.inner_kfold)
    assert sk == se.ClassifierConfig()  # the default is today's scikit-learn path
    keys = [se.transfer_resume_key(c, {"model": "m"}) for c in (sk, test, fast)]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3
    assert keys[1]["classifier"]["pytorch"]["optim"] == "adam" and "n_jobs" not in keys[1]["classifier"]
    # the scikit-learn key is the one written before the option existed: its partial files stay valid
    assert set(keys[0]["classifier"]) == {"c_grid", "kfold_c_grid", "kfold", "inner_kfold", "seed", "max_iter",
                                          "mrpc_features"}
    with pytest.raises(ValueError, match="optim"):
        ts.TorchClassifierConfig(optim="sgd")


def _bag_of_words(dim: int):
    """A stand-in encoder: the sum of crc32-seeded random word vectors, scaled to unit length."""
    import zlib

    vecs: dict = {}

    def encode(sentences):
        out = np.full((len(sentences), dim), 1e-3)
        for i, s in enumerate(sentences):
            for w in s.split():
                if w not in vecs:
                    vecs[w] = np.random.default_rng(zlib.crc32(w.encode())).standard_normal(dim)
                out[i] += vecs[w]
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    return encode


def test_trec_under_fasttest_is_near_the_sklearn_path_and_recorded(data_dir, tmp_path):
    """A third of TREC's training questions (every third line), all 500 test questions, a bag-of-words stand-in
    encoder: SimCSE's 'fasttest' classifier lands within a few points of the scikit-learn path on the same features
    (its grid cut to C = 1, what it picks here, to keep this short), and eval.json / eval.md say which classifier
    ran."""
    from pretrain.eval.cli import markdown_report, run_eval, write_outputs

    src, dst = data_dir / "senteval" / "TREC", tmp_path / "senteval" / "TREC"
    dst.mkdir(parents=True)
    lines = (src / "train_5500.label").read_bytes().splitlines(keepends=True)
    (dst / "train_5500.label").write_bytes(b"".join(lines[::3]))
    (dst / "TREC_10.label").write_bytes((src / "TREC_10.label").read_bytes())
    encode = _bag_of_words(128)
    quiet = lambda *_: None  # noqa: E731
    fast = run_eval(encode, tmp_path, ("transfer",), transfer_tasks=["TREC"], log=quiet,
                    classifier_cfg=ts.transfer_classifier("pytorch-fasttest", n_jobs=1))
    sk = run_eval(encode, tmp_path, ("transfer",), transfer_tasks=["TREC"], log=quiet,
                  classifier_cfg=ts.transfer_classifier("sklearn", n_jobs=1, kfold=5, kfold_c_grid=(1.0,)))
    got, ref = fast["transfer"]["TREC"], sk["transfer"]["TREC"]
    assert ref["acc"] > 55 and abs(got["acc"] - ref["acc"]) < 5, (got, ref)  # 500 questions: ~2 points of noise
    assert abs(got["devacc"] - ref["devacc"]) < 3, (got, ref)  # the mean over 5 folds of ~360 questions
    assert got["l2reg"] in (1e-5, 1e-4, 1e-3, 1e-2) and got["n"] == 500
    write_outputs(tmp_path / "out", fast, markdown_report("bow", fast))
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["transfer_classifier"]["backend"] == "pytorch" and saved["transfer_classifier"]["kfold"] == 5
    assert saved["transfer_classifier"]["pytorch"]["optim"] == "rmsprop"
    assert "Classifier: SentEval's PyTorch path: linear layer, rmsprop" in (tmp_path / "out" / "eval.md").read_text()
    assert sk["transfer_classifier"]["backend"] == "sklearn"
