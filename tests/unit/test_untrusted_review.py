"""Files from elsewhere are untrusted: what a user is handed (a HF directory for --backend transformers, a study
file) runs no code of its own and is never unpickled; what we write travels as safetensors with the user's umask;
a tool's work directory is never one another user could have made first."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]


def _tiny_bert(d: Path) -> Path:
    """A transformers BertModel (random, tiny) saved in ``d`` with a word-piece vocab.txt."""
    import transformers

    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    transformers.BertModel(config).save_pretrained(str(d))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(25))]
    (d / "vocab.txt").write_text("\n".join(words) + "\n")
    return d


def test_transformers_backend_refuses_a_handed_pytorch_model_bin(tmp_path):
    """--backend transformers (pretrain-eval, pretrain-finetune-glue) read a directory's pytorch_model.bin with
    torch.load(weights_only=True): pickle's machinery on a file from elsewhere. It is refused, as by the pretrain
    backend, with what to do."""
    from safetensors.torch import load_file

    from pretrain.eval.encoder import load_backbone

    d = _tiny_bert(tmp_path / "hf")
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin, a pickle.*never unpickles.*save_pretrained"):
        load_backbone(d, backend="transformers")


def test_transformers_backend_runs_no_code_of_a_handed_directory(tmp_path):
    """A config.json / tokenizer_config.json naming custom code (auto_map) made transformers ask on stdin whether to
    run it; an answer of "y" ran it. It is refused without asking."""
    d = _tiny_bert(tmp_path / "hf")
    marker = tmp_path / "ran"
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="custombert", auto_map={"AutoConfig": "custom.Config", "AutoModel": "custom.Model"})
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Tok",
                                                         "auto_map": {"AutoTokenizer": ["custom.Tok", None]}}))
    (d / "custom.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n"
                                 "from transformers import BertConfig as Config, BertModel as Model\n"
                                 "from transformers import BertTokenizerFast as Tok\n")
    code = ("import sys\nfrom pretrain.eval.hf_backend import HFBackbone, HFTokenizer\n"
            "for make in (HFBackbone, HFTokenizer):\n"
            "    try:\n        make(sys.argv[1])\n        print('loaded', make.__name__)\n"
            "    except ValueError as e:\n        print('refused', make.__name__, str(e).splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(d)], input="y\ny\n", capture_output=True, text=True,
                         cwd=REPO, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not marker.exists(), out.stdout + out.stderr
    assert "refused HFBackbone" in out.stdout and "refused HFTokenizer" in out.stdout, out.stdout + out.stderr
    assert "wish to run the custom code" not in out.stdout + out.stderr


class _TiedBackbone(nn.Module):
    """encode(ids, mask) -> h_BTD, with a decoder tied to the embeddings (one tensor under two names)."""

    hidden_size = 8

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.decoder = nn.Linear(8, 50, bias=False)
        self.decoder.weight = self.emb.weight

    def encode(self, input_ids_BT, attention_mask_BT, all_layers=False):
        return self.emb(input_ids_BT)


class _Words:
    pad_id, cls_id, sep_id = 0, 1, 2

    def encode(self, text):
        return [3 + sum(map(ord, w)) % 40 for w in text.split()]


def test_glue_save_best_writes_safetensors_with_the_users_umask(tmp_path):
    """pretrain-finetune-glue --save-best wrote best_model.pt, a pickle that whoever opens it unpickles: weights
    travel as safetensors (tied tensors stored once each), at the mode the user's umask gives."""
    from safetensors.torch import load_file

    from pretrain.eval.glue import FinetuneConfig, finetune

    rows = ["sentence\tlabel"] + [f"{'good' if i % 2 else 'bad'} film {i}\t{i % 2}" for i in range(16)]
    for split in ("train", "dev"):
        (tmp_path / "glue" / "SST-2").mkdir(parents=True, exist_ok=True)
        (tmp_path / "glue" / "SST-2" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    save = tmp_path / "best"
    old = os.umask(0o002)  # group-writable: neither safetensors' 0600 nor a fixed 0644
    try:
        finetune(FinetuneConfig(task="sst2", lr=1e-2, batch_size=8, epochs=1, seed=1), _TiedBackbone(),
                 _Words(), tmp_path / "glue", save_dir=save, log=lambda *_: None)
    finally:
        os.umask(old)
    assert sorted(p.name for p in save.iterdir()) == ["best_model.safetensors"]
    state = load_file(str(save / "best_model.safetensors"))
    assert {"backbone.emb.weight", "backbone.decoder.weight"} <= set(state)
    assert torch.equal(state["backbone.emb.weight"], state["backbone.decoder.weight"])
    assert (save / "best_model.safetensors").stat().st_mode & 0o777 == 0o664


def test_a_study_file_runs_only_pretrains_own_clis(tmp_path):
    """A study file is handed around as configs are: its prep commands ran any program (sh -c ...) and its env:
    could set PYTHONPATH or LD_PRELOAD for every step. Both are refused when it is read, before anything runs."""
    from pretrain.study.plan import StudyError, load_study

    arms = "arms:\n  - {name: a, config: configs/quickstart.yaml, seeds: [1]}\n"
    study = tmp_path / "s.yaml"
    study.write_text("name: s\nprep:\n  - {name: tok, output: tok.json, command: [sh, -c, 'touch ran']}\n" + arms)
    with pytest.raises(StudyError, match=r"command \['sh'\] is not one of pretrain's CLIs"):
        load_study(study)
    for key in ("PYTHONPATH", "LD_PRELOAD", "PATH"):
        study.write_text(f"name: s\nenv: {{OMP_NUM_THREADS: '2', {key}: /tmp/x}}\n" + arms)
        with pytest.raises(StudyError, match=f"env: {key} may not be set by a study file"):
            load_study(study)
    study.write_text("name: s\nenv: {OMP_NUM_THREADS: '2'}\nprep:\n  - {name: tok, output: tok.json, command: "
                     "[pretrain-tokenizer, x, --out, '{output}']}\n" + arms)
    assert load_study(study).env == {"OMP_NUM_THREADS": "2"}


def test_study_weights_digest_checks_the_header_size_before_reading(tmp_path):
    """A model.safetensors whose 8-byte header size is past the file's end: a StudyError naming it, not a bare
    MemoryError from allocating what the header claims."""
    from pretrain.study.outputs import weights_digest
    from pretrain.study.plan import StudyError

    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(StudyError, match=r"header claims 1099511627776 bytes, the file has 10"):
        weights_digest(bad)


def test_tool_work_directories_are_the_users_own(tmp_path):
    """tools/padding_share.py, bench_data.py and bench_step.py preprocessed into fixed names under /tmp and read
    back whatever dataset was there: another user who made the directory first chose it. The default is the
    user's cache; a directory anyone may write into (or another user owns) is refused."""
    import tempfile

    import padding_share

    assert not str(padding_share.DEFAULT_WORK).startswith(tempfile.gettempdir())
    shared = tmp_path / "pretrain-padding-share"
    planted = shared / "books-tok"
    planted.mkdir(parents=True)
    (planted / "manifest.json").write_text("{}")
    shared.chmod(0o777)
    with pytest.raises(SystemExit, match="anyone may write into it"):
        padding_share.prepare(shared, str(tmp_path / "tok" / "tokenizer.json"), 20, ("books",))
    if os.getuid() == 0:
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        with pytest.raises(SystemExit, match="another user owns it"):
            padding_share.work_dir(shared)
    assert padding_share.work_dir(tmp_path / "mine") == tmp_path / "mine"


def test_a_token_freq_header_claiming_terabytes_is_named_not_allocated(tmp_path):
    """SARCSE's token_freq.npy (objective.reconstruction.token_freq, a file handed over): a header claiming 2^40
    entries made np.load try to allocate 8 TiB (a bare MemoryError); the mapped load checks it against the file."""
    from pretrain.training.resources import load_token_freq

    good = tmp_path / "good.npy"
    np.save(good, np.full(8, 1 / 8))
    raw = good.read_bytes()
    bad = tmp_path / "token_freq.npy"
    shape = f"({2**40},)".encode()  # the header keeps its length: as many padding spaces fewer
    bad.write_bytes(raw.replace(b"(8,)", shape).replace(b" " * (len(shape) - 4) + b"\n", b"\n", 1))
    with pytest.raises(ValueError, match="token_freq.npy: not a whole .npy array"):
        load_token_freq(bad)
    assert load_token_freq(good).sum().item() == pytest.approx(1.0)
