"""Realistic bad input and interrupted runs of ``pretrain-preprocess``: each case named with what to do, nothing
half-written published, a rerun after a kill complete and identical to an uninterrupted run."""

from __future__ import annotations

import bz2
import errno
import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from pretrain.distributed.env import unique_suffix
from pretrain.prep import preprocess as pp
from pretrain.prep.readers import ReadStats, read_file
from pretrain.prep.tokenizer import train_tokenizer

WORDS = "alpha beta gamma delta river mountain forest city music science history language people".split()


def _text(num_docs: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)

    def sentence() -> str:
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=8)).capitalize() + "."

    return "\n\n".join("\n".join(sentence() + " " + sentence() for _ in range(3)) for _ in range(num_docs)) + "\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "a.txt").write_text(_text(50))
    return train_tokenizer([str(root / "a.txt")], str(root / "tokenizer.json"), vocab_size=200,
                           min_frequency=1).path


def _run(args, capsys) -> tuple[int, str]:
    code = pp.main([str(a) for a in args] + ["--workers", "1", "--no-progress"])
    out = capsys.readouterr()
    return code, out.out + out.err


def _shard_sums(out) -> list:
    m = json.loads((out / "manifest.json").read_text())
    return [(s["bin_sha256"], s["idx_sha256"]) for s in m["shards"]] + [m["token_freq"]["sha256"]]


# ------------------------------------------------------------------------------------------ the output directory


def test_overwrite_never_deletes_a_directory_that_is_not_a_dataset(tok, tmp_path, capsys):
    """The refusal used to say "pass --overwrite" for any non-empty directory, and --overwrite then replaced
    it whole: `--out corpus/` deleted the corpus itself."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(_text(5))
    (corpus / "notes.md").write_text("mine\n")
    code, text = _run([corpus / "a.txt", "--tokenizer", tok, "--out", corpus, "--overwrite"], capsys)
    assert code == 2 and "lies inside the output directory" in text
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("mine\n")
    code, text = _run([corpus / "a.txt", "--tokenizer", tok, "--out", other, "--overwrite"], capsys)
    assert code == 2 and "not part of a dataset (notes.md)" in text and "choose another --out" in text
    assert sorted(os.listdir(corpus)) == ["a.txt", "notes.md"] and os.listdir(other) == ["notes.md"]
    assert sorted(os.listdir(tmp_path)) == ["corpus", "other"]
    ds = tmp_path / "ds"  # a dataset is still replaced by --overwrite, and refused without it
    assert _run([corpus / "a.txt", "--tokenizer", tok, "--out", ds], capsys)[0] == 0
    code, text = _run([corpus / "a.txt", "--tokenizer", tok, "--out", ds], capsys)
    assert code == 2 and "already holds a complete dataset; pass --overwrite" in text
    (ds / "index-cache").mkdir()  # what training adds to a dataset (its index caches): still a dataset
    (ds / "index-cache" / "samples-x.npy").write_bytes(b"")
    assert _run([corpus / "a.txt", "--tokenizer", tok, "--out", ds, "--overwrite"], capsys)[0] == 0
    assert not (ds / "index-cache").exists()  # replaced with the rest: the new dataset's caches are built anew


def test_a_killed_runs_partial_directory_is_removed_and_a_live_ones_refused(tok, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(_text(20))
    host = unique_suffix().rsplit("-", 2)[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ds.partial-{host}-{dead.pid}-0badf00d"
    stale.mkdir()
    (stale / "shard-00000.bin.tmp").write_bytes(b"\0" * 1000)
    foreign = tmp_path / ".ds.partial-otherhost-1-0badf00d"
    foreign.mkdir()
    with pytest.warns(UserWarning) as caught:
        pp.preprocess([str(src)], str(tmp_path / "ds"), tok, progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert f"removing {stale}" in said and f"{foreign} is left by a run on host otherhost" in said
    assert not stale.exists() and foreign.exists() and (tmp_path / "ds" / "manifest.json").is_file()
    live = tmp_path / f".ds2.partial-{host}-{os.getpid()}-0badf00d"
    live.mkdir()
    with pytest.raises(ValueError, match=rf"another pretrain-preprocess \(pid {os.getpid()}\) is writing"):
        pp.preprocess([str(src)], str(tmp_path / "ds2"), tok, progress=False)
    assert live.exists() and not (tmp_path / "ds2").exists()


def test_sigkill_mid_run_then_the_same_command_gives_the_uninterrupted_dataset(tok, tmp_path):
    src = tmp_path / "big.txt"
    src.write_text(_text(400) * 40)  # ~5 MB: a few seconds with one worker
    cmd = [sys.executable, "-m", "pretrain.prep.preprocess", str(src), "--tokenizer", tok, "--workers", "1",
           "--no-progress", "--shard-size-tokens", "20000"]
    assert subprocess.run(cmd + ["--out", str(tmp_path / "ref")], capture_output=True).returncode == 0
    proc = subprocess.Popen(cmd + ["--out", str(tmp_path / "ds")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill once the first shard is written
        partial = [p for p in tmp_path.glob(".ds.partial-*") if (p / "shard-00000.bin").exists()]
        if partial or proc.poll() is not None:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if not partial:
        pytest.skip("the run ended before it could be killed mid-way")
    assert not (tmp_path / "ds").exists() and partial[0].exists()
    again = subprocess.run(cmd + ["--out", str(tmp_path / "ds")], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "removing" in again.stderr and not partial[0].exists()
    assert _shard_sums(tmp_path / "ds") == _shard_sums(tmp_path / "ref")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "ds", "ref"]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:  # a zombie waiting for init to reap it has ended
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_workers_of_a_killed_run_end_with_it_silently(tok, tmp_path):
    """A SIGKILLed (OOM-killed) run's pool workers used to finish their parts and then print a BrokenPipeError
    traceback each onto the console the user had back; now they end with it (PR_SET_PDEATHSIG)."""
    src = tmp_path / "big.txt"
    src.write_text(_text(400) * 40)
    err = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "pretrain.prep.preprocess", str(src), "--tokenizer", tok, "--workers", "2",
           "--no-progress", "--shard-size-tokens", "20000", "--out", str(tmp_path / "ds")]
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
    deadline, workers = time.monotonic() + 60, []
    while time.monotonic() < deadline and proc.poll() is None:  # kill once both workers work
        workers = _children(proc.pid)
        if len(workers) >= 2 and list(tmp_path.glob(".ds.partial-*/shard-00000.bin")):
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if len(workers) < 2:
        pytest.skip("the run ended before its workers could be seen")
    deadline = time.monotonic() + 30
    while any(_running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(w) for w in workers)
    text = err.read_text()
    assert "Traceback" not in text and "BrokenPipeError" not in text, text[-2000:]


def test_a_full_disk_is_named_and_leaves_the_old_dataset_as_it_was(tok, tmp_path, capsys, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text(_text(20))
    ds = tmp_path / "ds"
    assert _run([src, "--tokenizer", tok, "--out", ds], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in ds.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pp.np, "save", full)  # token_freq.npy: after every shard is written
    code, text = _run([src, "--tokenizer", tok, "--out", ds, "--overwrite"], capsys)
    assert code == 2 and "No space left on device" in text and "free space on the disk of" in text
    assert "Traceback" not in text and {p.name: p.read_bytes() for p in ds.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "ds"]


# ------------------------------------------------------------------------------------------------ text inputs


@pytest.mark.parametrize("compress", [None, gzip.compress])
def test_lone_cr_line_endings_are_refused_not_read_as_one_line(tmp_path, compress):
    """A classic-Mac file used to become one line: its documents merged into one, or (over --max-line-bytes)
    the whole file skipped as one giant line."""
    data = _text(20).replace("\n", "\r").encode()
    path = tmp_path / ("mac.txt.gz" if compress else "mac.txt")
    path.write_bytes(compress(data) if compress else data)
    with pytest.raises(ValueError, match=r"mac\.txt(\.gz)? has lone CR \(classic Mac\) line endings.*tr '\\r' '\\n'"):
        list(read_file(str(path), ReadStats()))
    path.write_bytes(_text(20).replace("\n", "\r\n").encode())  # CRLF stays fine
    assert len(list(read_file(str(path), ReadStats()))) == 20


@pytest.mark.parametrize("content, why", [
    (b'{"id": 1, "content": "Alpha beta gamma delta river."}\n' * 3, "has no field 'text' (its fields: id, content)"),
    (b'[{"text": "Alpha beta gamma delta river."},\n {"text": "Beta gamma."}]\n', "is not JSON"),
    (b'[{"text": "Alpha beta gamma delta river."}, {"text": "Beta gamma."}]\n', "is a JSON array"),
    (b'{"text": 12}\n{"text": null}\n', "has 'text' of JSON type int, not a string"),
])
def test_jsonl_without_a_single_usable_record_is_refused_naming_the_first(tmp_path, content, why):
    """A wrong --text-field or a .json array used to vanish as a bad_json count (the file silently skipped)."""
    path = tmp_path / "data.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="lines is a JSON object with a string .text. field") as e:
        list(read_file(str(path), ReadStats()))
    assert why in str(e.value) and "--text-field NAME" in str(e.value) and "byte offset" in str(e.value)
    stats = ReadStats()  # a few bad lines among good ones are still skipped and counted
    path.write_bytes(content + b'{"text": "Alpha beta gamma delta river."}\n')
    assert len(list(read_file(str(path), stats))) == 1 and stats.skipped["bad_json"] >= 1


def test_nothing_produced_because_of_giant_lines_points_at_max_line_bytes(tok, tmp_path, capsys):
    src = tmp_path / "one_line.txt"
    src.write_bytes(b"Alpha beta gamma delta river city music. " * 30_000)  # 1.2 MB, no newline
    code, text = _run([src, "--tokenizer", tok, "--out", tmp_path / "ds"], capsys)
    assert code == 2 and "giant_line" in text and "--max-line-bytes" in text
    assert sorted(os.listdir(tmp_path)) == ["one_line.txt"]


@pytest.mark.parametrize("kind", ["gz", "bz2", "xz", "zst"])
def test_a_corrupt_block_in_the_middle_of_a_stream_is_named(tok, tmp_path, capsys, kind):
    """Already right before this review (evidence): a flipped run of bytes mid-stream stops the run by name."""
    import zstandard

    data = _text(400).encode()
    blob = bytearray({"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
                      "zst": zstandard.ZstdCompressor().compress}[kind](data))
    for i in range(len(blob) // 2, len(blob) // 2 + 16):
        blob[i] ^= 0x55
    path = tmp_path / f"bad.txt.{kind}"
    path.write_bytes(bytes(blob))
    code, text = _run([path, "--tokenizer", tok, "--out", tmp_path / "ds"], capsys)
    assert code == 2 and f"bad.txt.{kind}: the" in text and "stream is truncated or corrupt" in text
    assert os.listdir(tmp_path) == [path.name]


def test_warnings_module_is_quiet_for_a_clean_run(tok, tmp_path):
    """No stale-partial warning when there is nothing to clean."""
    src = tmp_path / "a.txt"
    src.write_text(_text(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pp.preprocess([str(src)], str(tmp_path / "ds"), tok, progress=False)
