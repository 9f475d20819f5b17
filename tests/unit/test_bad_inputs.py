"""Bad inputs to every CLI: each case checks the exit code and that the message names the problem.

The table (case -> CLI, argv, expected exit code, words the message must contain) is also in
docs/operations.md. CLIs run in-process through ``main(argv)``; two run as real subprocesses in tests/integration/test_cli_subprocess.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tiny_corpus, tmp_path_factory) -> dict:
    """Broken files next to the good tiny corpus, built once."""
    from pretrain.config.model import ModelConfig
    from pretrain.export.hf import write_init_dir
    from pretrain.model import build_model
    from pretrain.prep.tokenizer import load_tokenizer, train_tokenizer

    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "typo.yaml").write_text("optim:\n  lr: 1e-3\n  warmup_stepz: 5\n")
    (d / "broken.yaml").write_text("optim: {lr: 1e-3\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "bad_utf8.txt").write_bytes(b"A fine first sentence here.\nThen \xff\xfe broken bytes appear.\n")
    text = "The first sentence is here. The second one follows it.\n\nA new document starts now.\n"
    (d / "lf.txt").write_bytes(text.encode())
    (d / "crlf_bom.txt").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    (d / "giant.txt").write_bytes(b"A normal sentence before it.\n" + b"x" * (10 << 20) + b"\nAnd a normal one after.\n")
    (d / "not_a_dataset").mkdir()
    (d / "raw_corpus").mkdir()
    (d / "raw_corpus" / "a.txt").write_bytes(text.encode())
    (d / "prog").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9) + bytes(range(256)) * 4)
    import gzip

    blob = gzip.compress((text * 2000).encode())
    (d / "cut.txt.gz").write_bytes(blob[:len(blob) // 2])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2], "content": ["A first row of text.", "A second one."]}),
                   d / "no_text.parquet")
    (d / "no_ckpt").mkdir()
    other = d / "other_tok.json"  # a tokenizer the tiny datasets were not made with
    train_tokenizer([str(d / "lf.txt")], str(other), kind="wordpiece", vocab_size=200, min_frequency=1)
    vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    bigger = build_model(ModelConfig(vocab_size=vocab, hidden_size=48, num_layers=1, num_heads=2, ffn_size=64,
                                     max_position=64))
    write_init_dir(bigger, tiny_corpus["tokenizer"], str(d / "init_h48"))
    return {"dir": d, "tok": tiny_corpus["tokenizer"], "train": tiny_corpus["train"], "other_tok": str(other)}


def _tiny(inp, run_dir) -> dict:
    return {"run_dir": str(run_dir), "data.tokenizer": inp["tok"], "data.sources": f"[{{name: d, path: {inp['train']}}}]",
            "data.valid": "[]", "data.max_len": 64, "data.view_max_len": 32, "data.num_workers": 0,
            "model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "model.ffn_size": 64,
            "model.max_position": 64, "train.micro_batch_size": 4, "train.max_steps": 2,
            "distributed.timeout_s": 60}


def _argv(inp, run_dir, **changes) -> list[str]:
    kv = _tiny(inp, run_dir)
    kv.update({k.replace("__", "."): v.format(**{k2: str(v2) for k2, v2 in inp.items()}) if isinstance(v, str) else v
               for k, v in changes.items()})
    return [f"{k}={v}" for k, v in kv.items()]


# case id -> (cli, argv(inp, tmp_path), exit code, substrings of the message)
CASES = {
    # --- configs (pretrain-train) ---------------------------------------------------------------------
    "config_key_typo": ("train", lambda i, t: _argv(i, t) + ["optim.lrr=1e-3"], 2,
                        ["unknown config key(s) optim.lrr (optim.lrr: did you mean optim.lr?)",
                         "valid keys under optim"]),
    "config_file_key_typo": ("train", lambda i, t: [str(i["dir"] / "typo.yaml")] + _argv(i, t), 2,
                             ["optim.warmup_stepz", "did you mean optim.warmup_steps?"]),
    "config_wrong_type": ("train", lambda i, t: _argv(i, t, train__max_steps="ten"), 2,
                          ["train.max_steps", "expected an integer", "'ten'"]),
    "config_negative_lr": ("train", lambda i, t: _argv(i, t, optim__lr="-3e-4"), 2, ["optim.lr must be > 0", "-0.0003"]),
    "config_bad_choice": ("train", lambda i, t: _argv(i, t, train__precision="fp8"), 2,
                          ["train.precision", "'fp8' is not one of"]),
    "config_bad_zero_stage": ("train", lambda i, t: _argv(i, t, distributed__zero_stage=4), 2,
                              ["distributed.zero_stage must be 0, 1, 2 or 3"]),
    "config_missing_file": ("train", lambda i, t: [str(i["dir"] / "nope.yaml")], 2, ["nope.yaml does not exist"]),
    "config_invalid_yaml": ("train", lambda i, t: [str(i["dir"] / "broken.yaml")], 2, ["broken.yaml is not valid YAML"]),
    "override_without_equals": ("train", lambda i, t: [str(i["dir"] / "typo.yaml"), "optim.lr"], 2,
                                ["'optim.lr' must look like key.sub=value"]),
    "masking_prob_out_of_range": ("train", lambda i, t: _argv(i, t, data__masking__prob=1.5), 2,
                                  ["data.masking.prob must be in (0, 1)", "1.5"]),
    # --- paths and data (pretrain-train) --------------------------------------------------------------
    "tokenizer_missing": ("train", lambda i, t: _argv(i, t, data__tokenizer="{dir}/missing_tok.json"), 2,
                          ["missing_tok.json"]),
    "tokenizer_vocab_bigger_than_model": ("train", lambda i, t: _argv(i, t, model__vocab_size=100), 2,
                                          ["model.vocab_size=100 is smaller than the tokenizer's vocabulary"]),
    "tokenizer_not_the_datasets": ("train", lambda i, t: _argv(i, t, data__tokenizer="{other_tok}"), 2,
                                   ["was tokenized with tokenizer sha256", "re-run pretrain-preprocess"]),
    "dataset_dir_missing": ("train", lambda i, t: _argv(i, t, data__sources="[{{name: d, path: {dir}/gone}}]"), 2,
                            ["gone does not exist", "pretrain-preprocess"]),
    "dataset_without_manifest": ("train", lambda i, t: _argv(
        i, t, data__sources="[{{name: d, path: {dir}/not_a_dataset}}]"), 2, ["no manifest.json", "incomplete"]),
    "dataset_is_raw_text": ("train", lambda i, t: _argv(i, t, data__sources="[{{name: d, path: {dir}/raw_corpus}}]"),
                            2, ["raw_corpus holds raw input files (a.txt), not a preprocessed dataset",
                                "pretrain-preprocess", "raw_corpus --tokenizer", "raw_corpus-data"]),
    "no_data_sources": ("train", lambda i, t: _argv(i, t, data__sources="[]"), 2, ["data.sources is empty"]),
    "init_from_other_model_size": ("train", lambda i, t: _argv(i, t, checkpoint__init_from="{dir}/init_h48"), 2,
                                   ["init_h48 does not fit this model", "another model size"]),
    "init_from_missing": ("train", lambda i, t: _argv(i, t, checkpoint__init_from="{dir}/no_ckpt"), 2,
                          ["no_ckpt is not a model directory pretrain can open", "trainer_state.json"]),
    # --- raw text (pretrain-preprocess) ---------------------------------------------------------------
    "empty_corpus": ("preprocess", lambda i, t: [str(i["dir"] / "empty.txt"), "--tokenizer", i["tok"], "--out",
                                                 str(t / "out"), "--workers", "1", "--no-progress"], 2,
                     ["no sentences were produced", "empty.txt"]),
    "invalid_utf8": ("preprocess", lambda i, t: [str(i["dir"] / "bad_utf8.txt"), "--tokenizer", i["tok"], "--out",
                                                 str(t / "out"), "--workers", "1", "--no-progress"], 2,
                     ["bad_utf8.txt: invalid UTF-8 at byte offset 33", "--errors replace"]),
    "binary_input": ("preprocess", lambda i, t: [str(i["dir"] / "prog"), "--tokenizer", i["tok"], "--out",
                                                 str(t / "out"), "--errors", "replace", "--no-progress"], 2,
                     ["prog is an ELF executable or library, not UTF-8 text"]),
    "truncated_gzip": ("preprocess", lambda i, t: [str(i["dir"] / "cut.txt.gz"), "--tokenizer", i["tok"], "--out",
                                                   str(t / "out"), "--workers", "1", "--no-progress"], 2,
                       ["cut.txt.gz: the gzip stream is truncated or corrupt"]),
    "parquet_without_text_column": ("preprocess", lambda i, t: [str(i["dir"] / "no_text.parquet"), "--tokenizer",
                                                                i["tok"], "--out", str(t / "out"), "--no-progress"], 2,
                                    ["no_text.parquet has no column 'text'; its columns are id, content",
                                     "--text-field"]),
    "input_missing": ("preprocess", lambda i, t: [str(i["dir"] / "nowhere.txt"), "--tokenizer", i["tok"], "--out",
                                                  str(t / "out"), "--no-progress"], 2, ["nowhere.txt does not exist"]),
    "verify_not_a_dataset": ("preprocess", lambda i, t: ["--verify", str(i["dir"] / "not_a_dataset")], 1,
                             ["no manifest.json", "1 problem(s)"]),
    # --- tokenizer training / conversion ------------------------------------------------------------------
    "tokenizer_empty_corpus": ("tokenizer", lambda i, t: [str(i["dir"] / "empty.txt"), "--out", str(t / "t.json")], 2,
                               ["no text found", "empty.txt"]),
    "tokenizer_binary_input": ("tokenizer", lambda i, t: [str(i["dir"] / "prog"), "--out", str(t / "t.json")], 2,
                               ["prog is an ELF executable or library, not UTF-8 text"]),
    "convert_no_checkpoint": ("convert", lambda i, t: ["to-hf", str(i["dir"] / "no_ckpt"), str(t / "hf")], 2,
                              ["no_ckpt is not a model directory pretrain can open", "trainer_state.json"]),
    "convert_missing_path": ("convert", lambda i, t: ["to-hf", str(i["dir"] / "nothing"), str(t / "hf")], 2,
                             ["nothing does not exist"]),
    # it said "has no config.json" (2026-12-08)
    "from_hf_missing_path": ("convert", lambda i, t: ["from-hf", str(i["dir"] / "nothing"), str(t / "init")], 2,
                             ["nothing does not exist; pass a Hugging Face BERT model directory"]),
}


def _cli(name: str):
    if name == "train":
        from pretrain.train import main
    elif name == "preprocess":
        from pretrain.prep.preprocess import main
    elif name == "tokenizer":
        from pretrain.prep.tokenizer import main
    else:
        from pretrain.export.convert import main
    return main


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_with_named_problem(case, inputs, tmp_path, capsys, clean_env):
    cli, make_argv, code, words = CASES[case]
    got = _cli(cli)(make_argv(inputs, tmp_path))
    out = capsys.readouterr()
    text = out.out + out.err
    assert got == code, text[-2000:]
    for w in words:
        assert w in text, f"{case}: {w!r} not in {text[-1500:]!r}"
    assert "Traceback" not in text, text[-6000:]
    if cli == "train":
        assert not (tmp_path / "metrics.jsonl").exists()


def test_giant_line_is_skipped_and_reported(inputs, tmp_path, capsys):
    from pretrain.data.shards import ShardedDataset
    from pretrain.prep.preprocess import main

    assert main([str(inputs["dir"] / "giant.txt"), "--tokenizer", inputs["tok"], "--out", str(tmp_path / "g"),
                 "--workers", "1", "--no-progress"]) == 0
    assert "giant_line" in capsys.readouterr().out  # the 10 MB line is counted in the report, not tokenized
    assert len(ShardedDataset(str(tmp_path / "g"))) == 2


def test_crlf_and_bom_give_the_same_dataset_as_lf(inputs, tmp_path, capsys):
    from pretrain.data.shards import ShardedDataset
    from pretrain.prep.preprocess import main

    for name in ("lf", "crlf_bom"):
        assert main([str(inputs["dir"] / f"{name}.txt"), "--tokenizer", inputs["tok"], "--out", str(tmp_path / name),
                     "--workers", "1", "--no-progress"]) == 0
    a, b = ShardedDataset(str(tmp_path / "lf")), ShardedDataset(str(tmp_path / "crlf_bom"))
    assert len(a) == len(b) == 3 and a.num_documents == b.num_documents == 2
    assert all(list(a[i]) == list(b[i]) for i in range(len(a)))


# ----------------------------------------------------------------------------- untrusted files in a run dir

def test_latest_naming_a_path_outside_the_checkpoints_is_not_followed(tmp_path):
    from pretrain.checkpoint import store

    ckpt = tmp_path / "run" / "checkpoints"
    for tag in ("step_00000002", "../../evil/step_00000009"):
        (ckpt / tag).mkdir(parents=True)
        (ckpt / tag / store.STATE_FILE).write_text("{}")
    (ckpt / store.LATEST_FILE).write_text("../../evil/step_00000009\n")
    assert store.find_latest(ckpt) == "step_00000002"
    (ckpt / store.LATEST_FILE).write_text(str((tmp_path / "evil" / "step_00000009").resolve()) + "\n")
    assert store.find_latest(ckpt) == "step_00000002"


def test_planted_pickle_in_rng_state_runs_no_code(tmp_path):
    import pickle

    from pretrain.checkpoint import store

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "rng_rank0.pt"
    with open(bad, "wb") as f:
        pickle.dump({"torch": Payload()}, f)
    with pytest.raises(store.CheckpointError, match="not a plain RNG-state file"):
        store.load_rng_state(bad)
    assert not marker.exists()
    good = tmp_path / "rng_ok.pt"
    torch.save({"torch": torch.get_rng_state(), "cuda": None}, good)
    assert torch.equal(store.load_rng_state(good)["torch"], torch.get_rng_state())


def test_trainer_state_versions_are_upgraded_and_newer_ones_refused(tmp_path):
    """Version 1 lacks the sample stream, version 2 the sample order: both are read with what they were
    trained on; a state from a newer pretrain is refused rather than resumed in an unknown order."""
    import json

    from pretrain.checkpoint import store

    tag = tmp_path / "step_00000004"
    tag.mkdir()
    for version, want in ((1, ("generator-v1", "permutation-v1")), (2, ("counter-v2", "permutation-v1")),
                          (3, ("counter-v2", "feistel-v1"))):
        state = {"format_version": version, "step": 4, "sample_stream": "counter-v2", "sample_order": "feistel-v1"}
        if version < 3:
            del state["sample_order"]
        if version < 2:
            del state["sample_stream"]
        (tag / store.STATE_FILE).write_text(json.dumps(state))
        got = store.read_trainer_state(tag)
        assert (got["format_version"], got["sample_stream"], got["sample_order"]) == (3, *want)
    (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION + 1, "step": 4}))
    with pytest.raises(store.CheckpointError, match="upgrade pretrain"):
        store.read_trainer_state(tag)


def test_universal_copies_go_with_their_checkpoint(tmp_path):
    """After a save, universal.prune keeps the copy of a checkpoint that is still there with the contents it was
    made from, and removes copies of removed or replaced (redone-step) checkpoints and interrupted conversions."""
    import json

    from pretrain.checkpoint import store, universal

    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        tag = ckpt / f"step_{step:08d}"
        tag.mkdir(parents=True)
        (tag / store.FILES_FILE).write_text(json.dumps({"files": {}, "step": step}))
        (tag / store.STATE_FILE).write_text(json.dumps({"format_version": 3, "step": step}))
    root = ckpt / universal.UNIVERSAL_DIR
    for name, source in (("step_00000002", ckpt / "step_00000002"), ("step_00000004", ckpt / "step_00000002"),
                         ("step_00000001", ckpt / "step_00000002"), (".tmp-step_00000004", None)):
        (root / name).mkdir(parents=True)
        if source is not None:
            (root / name / universal.UNIVERSAL_SOURCE).write_text(
                json.dumps({"checkpoint": universal._source_id(source), "files": {}}))
    universal.prune(ckpt)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]


def test_a_counter_v2_checkpoint_resumes_into_v3_with_a_warning_and_another_stream_is_refused(tmp_path, capsys):
    """counter-v3 corrected the views where v2's were wrong (a one-word text left without a word, inner [SEP]s
    moved): a v2 run resumes with one warning line naming the difference; a stream this version does not know
    is still refused."""
    from pretrain.config import RunConfig
    from pretrain.data.datasets import SAMPLE_STREAM
    from pretrain.training.resume import refuse_incompatible
    from pretrain.training.state import TrainState

    cfg = RunConfig()
    base = dict(step=4, consumed_samples=8, world_size=1, seed=cfg.seed, sample_order="feistel-v1")
    fields = {f for f in TrainState.__dataclass_fields__}
    for stream, refused in (("counter-v2", False), ("generator-v1", True), (SAMPLE_STREAM, False)):
        state = {k: v for k, v in dict(base, sample_stream=stream).items() if k in fields}
        old = TrainState(**{**{f: None for f in fields}, **state, **{"bad_steps_total": 0}})
        call = lambda: refuse_incompatible(old, tmp_path, {"train": {}, "distributed": {}}, cfg, 1,  # noqa: E731
                                           tokenizer_sha256="x", sample_stream=SAMPLE_STREAM)
        if refused:
            with pytest.raises(ValueError, match="sample stream 'generator-v1'"):
                call()
        else:
            call()
        out = capsys.readouterr().out
        assert ("one-word text" in out) == (stream == "counter-v2"), (stream, out)
