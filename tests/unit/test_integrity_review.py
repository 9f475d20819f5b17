"""Fault injection on what the project writes and reads back: each test damages a file the way a cluster does (a
file lost from a set, a stale file beside the new ones, a flipped byte in a large file) and checks that the reader
detects it before use, says what is wrong in one line, and uses nothing damaged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from pretrain.checkpoint import store
from pretrain.checkpoint.files import save_safetensors

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def trained_run(tiny_overrides, tmp_path_factory) -> Path:
    """A run directory with the checkpoints of steps 2 and 4 of a real tiny run (pretrain-train, in process)."""
    from pretrain.train import main

    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    saved = dict(os.environ)
    for k in _LAUNCH_VARS:
        os.environ.pop(k, None)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        code = main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, checkpoint__every=2))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert code == 0
    assert store.list_complete(store.checkpoints_dir(run_dir)) == ["step_00000002", "step_00000004"]
    return run_dir


def _copy(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir, dst)
    return store.checkpoints_dir(dst)


def test_a_checkpoint_that_lost_its_files_json_is_damaged_not_an_old_one(trained_run, tmp_path):
    """A partial copy of a tag without files.json (and here without a rank's optimizer file) was taken for a
    checkpoint from before checksums were recorded: verified by its state file only, and resumed from."""
    ckpts = _copy(trained_run, tmp_path / "run")
    tag_dir = ckpts / "step_00000004"
    (tag_dir / store.FILES_FILE).unlink()
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert store.verify_checkpoint(tag_dir) == [
        "files.json is missing (its trainer_state.json says the checkpoint's files are recorded there: a partial "
        "copy?)"]
    said = []
    assert store.find_resumable(ckpts, say=said.append) == "step_00000002"
    assert len(said) == 1 and "step_00000004 is damaged: files.json is missing" in said[0]


def test_a_rollback_rewriting_trainer_state_keeps_the_files_recorded_mark(trained_run, tmp_path):
    from pretrain.distributed.env import detect_env

    ckpts = _copy(trained_run, tmp_path / "run")
    tag_dir = ckpts / "step_00000002"
    state = store.read_trainer_state(tag_dir)
    store.record_trainer_state(detect_env(), tag_dir, {k: v for k, v in state.items() if k != store.FILES_RECORDED})
    (tag_dir / store.FILES_FILE).unlink()
    assert store.verify_checkpoint(tag_dir) and "files.json is missing" in store.verify_checkpoint(tag_dir)[0]


def test_a_stale_rank_file_beside_a_checkpoints_own_is_named(trained_run, tmp_path):
    """An optimizer partition of another save (another rank count) left in a tag passed verification; DeepSpeed's
    universal conversion lists the tag's rank files and then failed on it with "shape '[32]' is invalid"."""
    ckpts = _copy(trained_run, tmp_path / "run")
    tag_dir = ckpts / "step_00000004"
    shutil.copy(ckpts / "step_00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    problems = store.verify_checkpoint(tag_dir)
    assert len(problems) == 1 and problems[0].startswith("zero_pp_rank_1_mp_rank_00_optim_states.pt is not one of "
                                                         "the files the checkpoint was written with")
    assert f"move it out of {tag_dir}" in problems[0]
    said = []
    assert store.find_resumable(ckpts, say=said.append) == "step_00000002"
    assert len(said) == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt is not one of" in said[0]
    # files that are not weights (a note the user left) do not make a checkpoint damaged
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag_dir / "NOTES.txt").write_text("kept for the paper\n")
    assert store.verify_checkpoint(tag_dir) == []


def _big_checkpoint(root: Path) -> Path:
    """A complete, verifiable checkpoint whose model.safetensors (~10 MB) is larger than the sampled checksum
    reads (SAMPLE_BLOCKS x SAMPLE_BLOCK = 8 MiB)."""
    from tokenizers import Tokenizer, models

    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(20_000 - 5)]
    cfg = dict(vocab_size=len(words), hidden_size=64, num_layers=1, num_heads=2, ffn_size=64, max_position=32)
    tag = store.checkpoints_dir(root) / store.tag_for_step(4)
    tag.mkdir(parents=True)
    Tokenizer(models.WordPiece({t: i for i, t in enumerate(words)}, unk_token="[UNK]")).save(
        str(tag / "tokenizer.json"))
    model = build_model(ModelConfig(**cfg), seed=0)
    save_safetensors({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                     tag / store.WEIGHTS_FILE, metadata={"format": "pt"})
    (tag / "config.yaml").write_text(yaml.safe_dump({"model": cfg, "data": {"tokenizer": "tokenizer.json",
                                                                            "max_len": 32}}))
    store.record_files(tag, {})
    (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": 4}))
    return tag


def test_a_flipped_byte_between_the_sampled_blocks_of_the_weights_is_refused_by_weight_readers(tmp_path):
    """to-hf, pretrain-eval, init_from and teachers read model.safetensors after the sampled check, which reads
    8 MiB of it: a byte flipped between its blocks went into the export unseen."""
    tag = _big_checkpoint(tmp_path / "run")
    weights = tag / store.WEIGHTS_FILE
    size = weights.stat().st_size
    assert size > store.SAMPLE_BLOCK * store.SAMPLE_BLOCKS
    block_end = round(3 * (size - store.SAMPLE_BLOCK) / (store.SAMPLE_BLOCKS - 1)) + store.SAMPLE_BLOCK
    next_start = round(4 * (size - store.SAMPLE_BLOCK) / (store.SAMPLE_BLOCKS - 1))
    at = (block_end + next_start) // 2  # in a tensor's data, read by no sampled block
    assert block_end < at < next_start
    store.load_model_state(tag)  # intact: reads
    raw = bytearray(weights.read_bytes())
    raw[at] ^= 0x40
    weights.write_bytes(bytes(raw))
    assert store.verify_checkpoint(tag) == []  # what a resume checks: sizes + sampled sha256 (cheap, by design)
    with pytest.raises(store.CheckpointError, match=r"step_00000004 is damaged: model.safetensors: sha256 differs"):
        store.load_model_state(tag)


def test_a_sample_index_cache_damaged_inside_is_named_before_a_batch_reads_it(tiny_corpus, tmp_path):
    """The cache is checked at its ends when opened (a full scan costs seconds at 1e9 sentences): a start flipped
    inside it went to the shards' gather, which failed with an IndexError listing every range of the batch (a
    training run: a traceback, exit 1), naming neither the cache nor what to do."""
    import numpy as np

    from pretrain.data.sample_index import load_or_build_sample_index
    from pretrain.data.shards import ShardedDataset

    ds = ShardedDataset(str(shutil.copytree(tiny_corpus["train"], tmp_path / "train")))
    index = load_or_build_sample_index(ds, 62)
    k = len(index) // 2
    raw = bytearray(index.path.read_bytes())
    raw[128 + 8 * k + 2] ^= 0x10  # sample k's first sentence + 2**20: past the dataset's end
    index.path.write_bytes(bytes(raw))
    index = load_or_build_sample_index(ShardedDataset(str(tmp_path / "train")), 62)  # its ends are intact: used
    batch = np.array([0, k, len(index) - 1])
    with pytest.raises(ValueError) as e:
        ds.token_batch(*index.ranges(batch), 62)
    assert str(e.value).startswith(f"the sample index cache {index.path} is damaged: sample {k} covers sentences")
    assert f"Delete {index.path} and relaunch" in str(e.value) and len(str(e.value)) < 500
    index.path.unlink()
    first, end = load_or_build_sample_index(ShardedDataset(str(tmp_path / "train")), 62).ranges(batch)  # rebuilt
    assert ds.token_batch(first, end, 62)[0].shape[0] == 3


def test_the_checked_stamp_is_written_only_once_the_shards_it_vouches_for_are_on_the_disk(tiny_corpus, tmp_path,
                                                                                          monkeypatch):
    """The stamp lets a later open skip the .idx structure check for files of the same size and mtime. Written while a
    fresh copy of the shards was only in the page cache, it outlived them in a crash (XFS, ext4 writeback: the ends
    of the files read back as zeros at their full size and mtime) and the zeroed index was used unchecked."""
    import pretrain.data.shards as shards_mod

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(shards_mod.os, "fsync", fsync)
    monkeypatch.setattr(shards_mod.os, "replace", replace)
    ds_dir = shutil.copytree(tiny_corpus["train"], tmp_path / "train", ignore=shutil.ignore_patterns("index-cache"))
    shards_mod.ShardedDataset(str(ds_dir))
    stamp = next(i for i, e in enumerate(events) if e[0] == "replace" and Path(e[1]).name.startswith("checked-"))
    synced = {Path(e[1]).name for e in events[:stamp] if e[0] == "fsync"}
    assert {"shard-00000.idx", "shard-00000.bin"} <= synced, events


def _read_only(directory: Path) -> bool:
    """Make ``directory`` read-only for this process: chmod for a user, a read-only bind mount for root (whom modes
    do not stop); False where neither can be done."""
    import subprocess

    if os.geteuid() != 0:
        directory.chmod(0o555)
        return True
    for cmd in (["mount", "--bind", str(directory), str(directory)],
                ["mount", "-o", "remount,bind,ro", str(directory)]):
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            subprocess.run(["umount", str(directory)], capture_output=True)
            return False
    return True


def _writable_again(directory: Path) -> None:
    import subprocess

    if os.geteuid() != 0:
        directory.chmod(0o755)
    elif subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(directory)], check=False)


@pytest.mark.parametrize("where", ["run_dir", "checkpoints", "file_in_the_way"])
def test_a_run_dir_the_trainer_cannot_write_is_refused_at_the_start_in_one_line(where, tmp_path):
    """A read-only run directory failed with a traceback from the lock file (exit 1); read-only checkpoints/ went
    unnoticed until the first save, after the training since the last checkpoint, and failed with a traceback
    from DeepSpeed copying zero_to_fp32.py there."""
    from pretrain.distributed.env import detect_env
    from pretrain.training.run_lock import LOCK_NAME, RunDirLocked, lock_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    if where == "file_in_the_way":
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").write_text("not a directory\n")
        target = None
    else:
        target = run_dir if where == "run_dir" else run_dir / "checkpoints"
        if not _read_only(target):
            pytest.skip("cannot make a directory read-only here (root without mount)")
    try:
        with pytest.raises(RunDirLocked) as e:
            lock_run_dir(run_dir, detect_env())
    finally:
        if target is not None:
            _writable_again(target)
    said = str(e.value)
    named = run_dir / LOCK_NAME if where == "run_dir" else run_dir / "checkpoints"
    assert said.startswith(f"cannot write in {named} (") and "\n" not in said, said
    assert f"run_dir {run_dir}. Make it writable, or set another run_dir" in said
    assert not (run_dir / LOCK_NAME).exists()  # the lock taken before the checkpoints' probe was given back
    assert lock_run_dir(tmp_path / "other", detect_env()).release() is None  # a writable one is taken as before


def test_a_checkpoint_resumed_on_another_training_set_is_refused_unless_allowed(tiny_corpus, tiny_overrides,
                                                                                 tmp_path, capsys):
    """Another dataset put at the path a run trains on (same tokenizer) was resumed without a word: the run went on
    at the checkpoint's sample position in the new set's order. Checkpoints record what they were trained on
    (data_identity); a resume on another set is refused in one line, or goes on with a warning when
    checkpoint.allow_other_data=true."""
    from pretrain.train import main

    data = tmp_path / "data"
    shutil.copytree(tiny_corpus["train"], data)
    run_dir = tmp_path / "run"

    def train(steps: int, *extra: str) -> int:
        saved = dict(os.environ)
        for k in _LAUNCH_VARS:
            os.environ.pop(k, None)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            return main(tiny_overrides(run_dir, data__valid="[]", data__sources=f"[{{name: docs, path: {data}}}]",
                                       train__max_steps=steps, checkpoint__every=2) + list(extra))
        finally:
            os.environ.clear()
            os.environ.update(saved)

    assert train(2) == 0
    state = store.read_trainer_state(store.checkpoints_dir(run_dir) / "step_00000002")
    assert isinstance(state.get("data_identity"), str)
    assert train(4) == 0  # the same data: resumes
    shutil.rmtree(data)
    shutil.copytree(tiny_corpus["valid"], data)  # another dataset at the same path
    capsys.readouterr()
    assert train(6) == 2
    err = capsys.readouterr().err
    assert "was trained on another training set" in err and "checkpoint.allow_other_data=true" in err
    assert store.list_complete(store.checkpoints_dir(run_dir))[-1] == "step_00000004"
    assert train(6, "checkpoint.allow_other_data=true") == 0
    out = capsys.readouterr()
    assert "was trained on another training set (checkpoint.allow_other_data=true)" in out.out + out.err
    assert store.list_complete(store.checkpoints_dir(run_dir))[-1] == "step_00000006"
    now = store.read_trainer_state(store.checkpoints_dir(run_dir) / "step_00000006")["data_identity"]
    assert now != state["data_identity"]  # the run trains on the new set from here: its resumes compare with it


def test_what_names_the_last_good_checkpoint_skips_a_damaged_newer_one(trained_run, tmp_path):
    """The study took a run whose newest checkpoint is damaged as finished at that step (and hashed its weights);
    the divergence and failed-save messages named it as "the last good checkpoint" / "intact". They now name the
    newest that verifies, as a resume takes it."""
    from pretrain.study.driver import final_step

    ckpts = _copy(trained_run, tmp_path / "run")
    assert final_step(tmp_path / "run")[0] == 4
    weights = ckpts / "step_00000004" / store.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    assert final_step(tmp_path / "run") == (2, 4)
    assert store.find_intact(ckpts)[0] == "step_00000002"


def test_a_damaged_newest_state_does_not_stop_the_tools_that_read_the_runs_position(trained_run, tmp_path):
    """pretrain-inspect (--start: what the run draws next), the report and the study tables read the newest
    checkpoint's trainer_state; an unreadable one stopped them ("delete it to fall back") though a resume passes
    over it. They now read the state of the checkpoint a resume continues from."""
    ckpts = _copy(trained_run, tmp_path / "run")
    (ckpts / "step_00000004" / store.STATE_FILE).write_bytes(b"\0" * 64)  # a zero-filled state after a crash
    state = store.latest_trainer_state(tmp_path / "run")
    assert state is not None and state["step"] == 2
    with pytest.raises(store.CheckpointError, match="checkpoint is damaged"):
        store.read_trainer_state(ckpts / "step_00000004")


def test_a_damaged_safetensors_file_is_one_error_naming_it(tmp_path):
    """A safetensors file cut short (a copy stopped by a quota), empty, or of another format gave the reader's own
    ``SafetensorError`` traceback without the file's name; ``read_safetensors`` names the file, why and what to
    do, as the error type the callers turn into exit 2."""
    from pretrain.checkpoint.files import read_safetensors

    good = tmp_path / "good.safetensors"
    save_safetensors({"a.w": torch.ones(64, 64), "b.w": torch.zeros(3)}, good)
    assert set(read_safetensors(good)) == {"a.w", "b.w"}
    assert set(read_safetensors(good, keep=lambda k: k.startswith("a."))) == {"a.w"}
    raw = good.read_bytes()
    for name, data in (("cut", raw[: len(raw) // 2]), ("header_cut", raw[:20]), ("empty", b""),
                       ("text", b"not a tensor file\n" * 8)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"^{tmp_path / name} is damaged or not a safetensors file \(.+\): "
                                             r"copy it again or re-export it$"):
            read_safetensors(tmp_path / name)
    with pytest.raises(store.CheckpointError, match="cut is damaged or not a safetensors file"):
        read_safetensors(tmp_path / "cut", fix="use another", error=store.CheckpointError)


@pytest.fixture(scope="module")
def weights_dirs(trained_run, tmp_path_factory) -> dict:
    """From the trained run: a Hugging Face export (to-hf), an init directory (from-hf of it) and a run directory
    whose best/ is that init directory (the format best/ is written in), each intact; tests damage copies."""
    from pretrain.export.convert import main as convert_main

    root = tmp_path_factory.mktemp("weights_dirs")
    assert convert_main(["to-hf", str(trained_run), str(root / "hf")]) == 0
    assert convert_main(["from-hf", str(root / "hf"), str(root / "init")]) == 0
    shutil.copytree(trained_run, root / "run")
    shutil.copytree(root / "init", root / "run" / "best")
    (root / "run" / "best" / "best.json").write_text(json.dumps({"step": 4, "stsb_dev_spearman": 50.0,
                                                                 "pooling": "cls"}))
    return {"hf": root / "hf", "init": root / "init", "run": root / "run"}


def _glue_files(d: Path) -> Path:
    """Empty RTE train/dev files: enough for pretrain-finetune-glue to reach reading the model."""
    from pretrain.eval.glue_data import get_task, task_files

    for f in task_files(get_task("rte"), str(d)):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
    return d


# (the directory copied, the file in it cut short, the command with {d} for the copy, {t} for tmp_path)
_DAMAGED = {
    "to_hf_best": ("run", "best/model.safetensors", ["convert", "to-hf", "{d}", "{t}/out", "--checkpoint", "best"]),
    "eval_best": ("run", "best/model.safetensors", ["eval", "--model", "{d}", "--checkpoint", "best"]),
    "eval_hf": ("hf", "model.safetensors", ["eval", "--model", "{d}"]),
    "eval_hf_transformers": ("hf", "model.safetensors", ["eval", "--model", "{d}", "--backend", "transformers"]),
    "glue_hf": ("hf", "model.safetensors", ["glue", "--model", "{d}", "--out", "{t}/g", "--tasks", "rte",
                                            "--lrs", "1e-5", "--glue-dir", "{t}/glue"]),
    "from_hf": ("hf", "model.safetensors", ["convert", "from-hf", "{d}", "{t}/out"]),
    "from_hf_mlm": ("hf", "mlm/model.safetensors", ["convert", "from-hf", "{d}", "{t}/out"]),
    "to_hf_init": ("init", "model.safetensors", ["convert", "to-hf", "{d}", "{t}/out"]),
    "eval_init": ("init", "model.safetensors", ["eval", "--model", "{d}"]),
    "init_from": ("init", "model.safetensors", ["train", "checkpoint.init_from={d}", "--dry-run"]),
}


@pytest.mark.parametrize("case", list(_DAMAGED))
def test_a_damaged_weights_file_outside_a_checkpoint_is_one_line_and_exit_2(case, weights_dirs, tiny_overrides,
                                                                           tmp_path, capsys, clean_env):
    """A run's best/, a HF export, a from-hf init directory: no recorded digests, so a truncated model.safetensors
    reached the reader, whose SafetensorError traceback (exit 1) named no file. Each CLI now says which file is
    damaged and what to do, in one line, exit 2, and writes nothing."""
    from pretrain.eval import cli, glue_cli
    from pretrain.export.convert import main as convert_main
    from pretrain.train import main as train_main

    source, damaged, argv = _DAMAGED[case]
    d = tmp_path / source
    shutil.copytree(weights_dirs[source], d)
    raw = (d / damaged).read_bytes()
    (d / damaged).write_bytes(raw[: len(raw) // 2])
    (tmp_path / "senteval").mkdir()
    _glue_files(tmp_path / "glue")
    tool, *argv = [a.format(d=d, t=tmp_path) for a in argv]
    if tool == "train":
        argv = tiny_overrides(tmp_path / "new_run") + argv
    if tool == "eval":
        argv += ["--data-dir", str(tmp_path), "--suites", "transfer", "--no-progress"]
    main = {"convert": convert_main, "eval": cli.main, "glue": glue_cli.main, "train": train_main}[tool]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{d / damaged} is damaged or not a safetensors file (" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "new_run").exists()


def test_dry_run_with_a_damaged_init_from_checkpoint_says_it_in_one_line_as_the_run(trained_run, tiny_overrides,
                                                                                    tmp_path, capsys, clean_env):
    """``checkpoint.init_from`` naming a damaged checkpoint: the run ends in one line, exit 4; --dry-run ended in
    the CheckpointError's traceback (exit 1). It now gives the run's line and exit code."""
    from pretrain.train import main

    ckpts = _copy(trained_run, tmp_path / "run")
    weights = ckpts / "step_00000004" / store.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    argv = tiny_overrides(tmp_path / "new_run", checkpoint__init_from=ckpts / "step_00000004")
    assert main(argv + ["--dry-run"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "step_00000004 is damaged: model.safetensors has" in err and "pretrain-train --check" in err, err
    assert not (tmp_path / "new_run").exists()
