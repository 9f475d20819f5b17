"""Every recipe in configs/recipes/ runs here with `model=tiny` and nothing else but its data paths: a dry run,
then a few training steps in-process (real DeepSpeed; precision=auto: fp32 on a CPU, bf16 on one with AMX-BF16).

The CLEAR recipes train from scratch on the tiny corpus; the continued-training recipes (SimCSE, ArcCSE,
RankCSE) start from the tiny checkpoint one of them writes (`checkpoint.init_from`, as their headers say), SARCSE
from `pretrain-convert from-hf` of a randomly initialised tiny transformers RobertaModel (its byte-level BPE
tokenizer included).
The overrides below are data paths (the recipes name runs/tokenizer, data/wiki, checkpoints/bert-base-uncased,
...), run_dir, the step count and (for the test's time only) 2 validation batches instead of 20; a recipe
needing any other key to run here fails this test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pretrain.config.train import resolve_precision
from tests.integration.test_faults import _main

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs" / "recipes"
CLEAR = sorted(p.stem for p in RECIPES.glob("clear_*.yaml"))
CONTINUED = sorted(p.stem for p in RECIPES.glob("*.yaml") if not p.stem.startswith("clear_"))
FROM_ROBERTA = {"sarcse_roberta_base"}
STEPS = 2  # the first step and one after it: what the checks below read is the last step's
FAST = ["train.eval_batches=2"]  # held-out validation runs at step 0 and at the end: 2 batches, not 20


def test_the_recipe_lists_are_what_this_test_runs():
    assert len(CLEAR) == 4 and {"simcse_unsup_bert_base", "simcse_sup_bert_base", "arccse_bert_base",
                                "rankcse_listnet_bert_base", "rankcse_listmle_bert_base",
                                "sarcse_roberta_base"} == set(CONTINUED)
    for name in CLEAR + CONTINUED:
        assert "precision: auto" in (RECIPES / f"{name}.yaml").read_text(), name


def _sentences(corpus: dict, out: Path) -> str:
    """One sentence per line from the tiny corpus' training text (some of >= 25 words for ArcCSE's triplets)."""
    text = (Path(corpus["dir"]) / "text").glob("*train*")
    lines = [ln.strip() for f in text for ln in f.read_text(encoding="utf-8").splitlines() if len(ln.split()) >= 6]
    out.write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    return str(out)


def _pairs(sentences: str, out: Path) -> str:
    """data.pairs rows from those sentences: (sentence, itself without its last word, another sentence)."""
    lines = Path(sentences).read_text(encoding="utf-8").splitlines()
    rows = [(s, " ".join(s.split()[:-1]), lines[(i + 7) % len(lines)]) for i, s in enumerate(lines)]
    out.write_text("sent0\tsent1\thard_neg\n" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return str(out)


def _run(argv: list[str], capsys) -> str:
    code, out = _main([*argv, "--dry-run"], capsys)
    assert code == 0 and "dry run: config, tokenizer, data and model are fine" in out, out[-3000:]
    assert f"precision {resolve_precision('auto')}" in out, out
    code, out = _main(argv, capsys)
    assert code == 0, out[-3000:]
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clear_runs(tiny_corpus, tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("recipes"), "done": {}}


@pytest.mark.parametrize("name", CLEAR)
def test_clear_recipe_trains_with_model_tiny(name, tiny_corpus, clear_runs, clean_env, capsys, one_thread):
    run_dir = clear_runs["root"] / name
    argv = [str(RECIPES / f"{name}.yaml"), "model=tiny", f"run_dir={run_dir}", f"train.max_steps={STEPS}", *FAST,
            f"data.tokenizer={tiny_corpus['tokenizer']}",
            f"data.sources=[{{name: docs, path: {tiny_corpus['train']}}}]",
            f"data.valid=[{{name: docs, path: {tiny_corpus['valid']}}}]"]
    t0 = time.perf_counter()
    out = _run(argv, capsys)
    recs = _records(run_dir)
    train = [r for r in recs if r.get("split", "train") == "train" and "loss" in r]
    valid = [r for r in recs if r.get("split") == "valid"]
    assert train and train[-1]["step"] == STEPS and valid, out[-2000:]  # held-out figures from data.valid
    assert (run_dir / "checkpoints" / "latest").exists()
    for chatter in ("built successfully", "Loading checkpoint shards", "Processing zero checkpoint"):
        assert chatter not in out, chatter  # DeepSpeed's, kept off the console without --verbose
    clear_runs["done"][name] = run_dir
    print(f"{name}: {time.perf_counter() - t0:.1f} s")


@pytest.mark.parametrize("name", CONTINUED)
def test_continued_training_recipe_trains_from_a_tiny_checkpoint(name, tiny_corpus, clear_runs, data_dir, request,
                                                                 clean_env, capsys, one_thread, monkeypatch):
    start, tokenizer = clear_runs["done"].get("clear_del_span_reorder"), tiny_corpus["tokenizer"]
    if name in FROM_ROBERTA:
        start = _from_roberta(request.getfixturevalue("tiny_roberta"), clear_runs["root"] / "roberta_init")
        tokenizer = str(start / "tokenizer.json")
    if start is None:
        pytest.skip("needs the tiny checkpoint of test_clear_recipe_trains_with_model_tiny[clear_del_span_reorder]")
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(data_dir))  # STS-B dev for eval.stsb_every (the shared data)
    run_dir = clear_runs["root"] / name
    argv = [str(RECIPES / f"{name}.yaml"), "model=tiny", f"run_dir={run_dir}", f"train.max_steps={STEPS}",
            f"checkpoint.init_from={start}", f"data.tokenizer={tokenizer}",
            f"data.sentences={_sentences(tiny_corpus, clear_runs['root'] / 'sentences.txt')}"]
    if name == "simcse_sup_bert_base":  # trains on data.pairs instead
        argv[-1:] = ["data.sentences=", f"data.pairs={_pairs(argv[-1].split('=', 1)[1], clear_runs['root'] / 'p.tsv')}"]
    if name.startswith("rankcse"):
        argv.append(f"objective.rank_distill.teachers=[{start},{start}]")
    out = _run(argv, capsys)
    recs = _records(run_dir)
    assert [r["step"] for r in recs if r.get("split", "train") == "train" and "loss" in r][-1] == STEPS
    assert any(r.get("split") == "eval" for r in recs), out[-2000:]  # STS-B dev at the last step
    clear_runs["done"][name] = run_dir
    if name in FROM_ROBERTA:  # and back: a RobertaModel again
        from pretrain.export.convert import main as convert

        assert convert(["to-hf", str(run_dir), str(run_dir / "hf")]) == 0
        assert json.loads((run_dir / "hf" / "config.json").read_text())["architectures"] == ["RobertaModel"]


def _from_roberta(hf_dir: Path, out: Path) -> Path:
    """``pretrain-convert from-hf`` of a transformers RoBERTa directory -> the init directory (made once)."""
    from pretrain.export.convert import main as convert

    if not out.exists():
        assert convert(["from-hf", str(hf_dir), str(out)]) == 0
    return out


def test_readers_name_the_checkpoint_they_read(clear_runs, data_dir, tmp_path, capsys, monkeypatch):
    """pretrain-convert to-hf and pretrain-eval print the tag and step they read, take --checkpoint, and point
    at best/ (the SimCSE run above keeps it through eval.stsb_every)."""
    from pretrain.eval.cli import main as evaluate
    from pretrain.export.convert import main as convert

    run = clear_runs["done"].get("simcse_unsup_bert_base")
    if run is None:
        pytest.skip("needs the SimCSE run of test_continued_training_recipe_trains_from_a_tiny_checkpoint")
    assert (run / "best" / "best.json").is_file()
    assert convert(["to-hf", str(run), str(tmp_path / "hf"), "--checkpoint", "best"]) == 0
    out = capsys.readouterr().out
    assert f"reading {run}/best (step {STEPS}, STS-B dev" in out
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(data_dir))
    evaluate(["--model", str(run), "--checkpoint", f"step_{STEPS}", "--suites", "align"])
    got = capsys.readouterr()
    assert f"reading checkpoint step_{STEPS:08d} (step {STEPS}, as asked) of {run}" in got.out
    assert "encode" not in got.err  # progress bars only on a terminal
