"""STS readers (fixtures in the published layouts + real data counts) and metrics vs float64 references."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pretrain.eval import sts

_WORD_VECS: dict[str, np.ndarray] = {}


def bow_encode(sentences, dim=32):
    """Deterministic bag-of-words embedding (crc32-seeded word vectors): a stand-in encoder."""
    out = np.full((len(sentences), dim), 1e-3)
    for i, s in enumerate(sentences):
        for w in s.split():
            if w not in _WORD_VECS:
                _WORD_VECS[w] = np.random.default_rng(zlib.crc32(w.encode())).standard_normal(dim)
            out[i] += _WORD_VECS[w]
    return out.astype(np.float32)


def rank(x):
    """Average ranks (ties share the mean rank), independent of scipy."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        m = x == v
        r[m] = r[m].mean()
    return r


def spearman_ref(a, b):
    return 100 * np.corrcoef(rank(a), rank(b))[0, 1]


def write(path, text, newline="\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))


@pytest.fixture
def sts_dir(tmp_path):
    """STS15-like year with blank gold lines, STS-B with a 9-column row, SICK with CRLF."""
    rng = np.random.default_rng(0)
    words = "a man woman is playing guitar dog runs cat sleeps the on red blue".split()
    for year, subs in sts.STS_SUBSETS.items():
        for sub in subs:
            inp, gs = [], []
            for i in range(12):
                a = " ".join(rng.choice(words, 5))
                b = " ".join(rng.choice(words, 5))
                inp.append(f"{a}\t{b}")
                gs.append("" if (year == "STS15" and i % 4 == 0) else f"{rng.uniform(0, 5):.2f}")
            write(tmp_path / "sts" / f"{year}-en-test" / f"STS.input.{sub}.txt", "\n".join(inp) + "\n")
            write(tmp_path / "sts" / f"{year}-en-test" / f"STS.gs.{sub}.txt", "\n".join(gs) + "\n")
    rows = [f"main\tMSRvid\t2012\t{i:04d}\t{i % 5}.0\tsent {i} a\tsent {i} b" + ("\tx\ty" if i == 2 else "")
            for i in range(10)]
    write(tmp_path / "sts" / "STSBenchmark" / "sts-test.csv", "\n".join(rows) + "\n")
    write(tmp_path / "sts" / "STSBenchmark" / "sts-dev.csv", "\n".join(rows[:6]) + "\n")
    sick = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
    sick += [f"{i}\tA dog runs {i}\tA cat  sleeps {i}\t{1 + i * 0.3:.1f}\tNEUTRAL" for i in range(8)]
    write(tmp_path / "sts" / "SICK" / "SICK_test_annotated.txt", "\n".join(sick) + "\n", newline="\r\n")
    return tmp_path


def test_readers_on_fixtures(sts_dir):
    t15 = sts.load_sts_task(sts_dir, "STS15")
    assert [len(s.gold) for s in t15.subsets] == [9] * 5  # 3 of 12 gold lines blank
    stsb = sts.load_sts_task(sts_dir, "STSBenchmark")
    assert len(stsb.subsets[0].gold) == 10 and stsb.subsets[0].sent_b[2] == "sent 2 b"
    assert list(stsb.subsets[0].gold[:3]) == [0.0, 1.0, 2.0]
    sick = sts.load_sts_task(sts_dir, "SICKRelatedness").subsets[0]
    assert sick.sent_b[0] == "A cat sleeps 0" and not sick.sent_b[0].endswith("\r")
    assert sick.gold[-1] == pytest.approx(1 + 7 * 0.3)
    with pytest.raises(FileNotFoundError):
        sts.load_sts_task(sts_dir / "nope", "STS12")
    with pytest.raises(ValueError):
        sts.load_sts_task(sts_dir, "STS99")


def test_metrics_match_independent_reference(sts_dir):
    task = sts.load_sts_task(sts_dir, "STS12")
    sims = sts.predict_similarities(bow_encode, task)
    for sub, s in zip(task.subsets, sims):  # cosine against a direct float64 computation
        ea, eb = bow_encode(sub.sent_a).astype(np.float64), bow_encode(sub.sent_b).astype(np.float64)
        ref = (ea * eb).sum(1) / np.linalg.norm(ea, axis=1) / np.linalg.norm(eb, axis=1)
        np.testing.assert_allclose(s, ref, atol=1e-6)
    m = sts.sts_metrics(task, sims)
    per = [spearman_ref(s, sub.gold) for sub, s in zip(task.subsets, sims)]
    n = np.array([len(sub.gold) for sub in task.subsets], dtype=float)
    assert m["spearman"]["mean"] == pytest.approx(np.mean(per), abs=1e-9)
    assert m["spearman"]["wmean"] == pytest.approx(per @ (n / n.sum()), abs=1e-9)
    all_ref = spearman_ref(np.concatenate(sims), np.concatenate([s.gold for s in task.subsets]))
    assert m["spearman"]["all"] == pytest.approx(all_ref, abs=1e-9)
    assert m["spearman"]["all"] != pytest.approx(m["spearman"]["mean"], abs=1e-6)


def test_evaluate_sts_table_and_dev_evaluator(sts_dir):
    res = sts.evaluate_sts(bow_encode, sts_dir)
    table = sts.sts_markdown_table({"bow": res})
    header = table.splitlines()[0]
    assert header.split("|")[3:10] == [f" {n} " for n in ("STS12", "STS13", "STS14", "STS15", "STS16",
                                                            "STS-B", "SICK-R")]
    row_all = table.splitlines()[2].split("|")
    avg = np.mean([res[t]["spearman"]["all"] for t in sts.TASKS])
    assert float(row_all[-2]) == pytest.approx(avg, abs=0.006)
    ev = sts.StsbDevEvaluator(sts_dir)
    task = sts.load_sts_task(sts_dir, "STSBenchmark-dev")
    assert ev(bow_encode) == pytest.approx(spearman_ref(sts.predict_similarities(bow_encode, task)[0],
                                                        task.subsets[0].gold), abs=1e-9)


# Scored pairs per subset as listed in shared/data/MANIFEST.md §1a–1c.
EXPECTED = {
    "STS12": [750, 750, 459, 750, 399], "STS13": [189, 750, 561], "STS14": [450, 300, 750, 750, 750, 750],
    "STS15": [375, 750, 375, 750, 750], "STS16": [254, 249, 230, 244, 209],
    "STSBenchmark": [1379], "SICKRelatedness": [4927], "STSBenchmark-dev": [1500],
}


@pytest.mark.parametrize("variant", ["senteval", "original"])
def test_real_data_counts(data_dir, variant):
    for name, counts in EXPECTED.items():
        if variant == "original" and name == "SICKRelatedness":
            continue
        task = sts.load_sts_task(data_dir, name, variant)
        assert [len(s.gold) for s in task.subsets] == counts, name
        for s in task.subsets:
            assert all(a and b for a, b in zip(s.sent_a, s.sent_b))
            assert s.gold.min() >= 0 and s.gold.max() <= 5


def test_real_stsb_dev_evaluator_subset(data_dir):
    ev = sts.StsbDevEvaluator(data_dir, max_pairs=200)
    val = ev(bow_encode)
    assert -100 <= val <= 100 and len(ev.task.subsets[0].gold) == 200
