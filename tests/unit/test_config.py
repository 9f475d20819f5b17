"""Config system: YAML + include + dotted overrides, strict keys and types with dotted paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pretrain.config import RunConfig, from_dict, load_run_config, to_dict, to_yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def test_model_sizes_resolve_from_yaml_includes():
    sizes = {}
    for name in ("tiny", "mini", "small", "base", "large"):
        cfg = load_run_config(REPO / "configs" / "models" / f"{name}.yaml")
        m = cfg.model
        sizes[name] = (m.num_layers, m.hidden_size, m.num_heads, m.ffn_size)
    assert sizes["base"] == (12, 768, 12, 3072)  # BERT-base
    assert sizes["large"] == (24, 1024, 16, 4096)
    assert [sizes[n][1] for n in ("tiny", "mini", "small", "base", "large")] == sorted(
        sizes[n][1] for n in sizes)


def test_overrides_parse_values_and_win_over_files(tmp_path):
    cfg = load_run_config(REPO / "configs" / "quickstart.yaml",
                          ["optim.lr=3e-4", "model.norm=pre", "train.max_steps=7", "optim.betas=[0.9, 0.999]",
                           "data.sources=[{name: a, path: /x, weight: 2}]"])
    assert cfg.optim.lr == 3e-4 and cfg.model.norm == "pre" and cfg.train.max_steps == 7
    assert cfg.optim.betas == (0.9, 0.999)
    assert cfg.data.sources[0].name == "a" and cfg.data.sources[0].weight == 2.0
    assert cfg.model.hidden_size == 128  # from the included models/tiny.yaml


def test_include_order_and_local_keys_win(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 1\ntrain: {max_steps: 5, log_every: 2}\n")
    (tmp_path / "b.yaml").write_text("include: [a.yaml]\ntrain: {max_steps: 9}\n")
    cfg = load_run_config(tmp_path / "b.yaml")
    assert (cfg.seed, cfg.train.max_steps, cfg.train.log_every) == (1, 9, 2)


@pytest.mark.parametrize("override, fragment", [
    ("optim.lrr=1", "optim.lrr"),
    ("model.hiden_size=3", "model.hiden_size"),
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("optim.lr=-1", "optim.lr"),
    ("model.norm=middle", "model.norm"),
    ("distributed.zero_stage=4", "distributed.zero_stage"),
    ("data.masking.prob=1.5", "data.masking.prob"),
    ("model.hidden_size=100", "model.num_heads"),
    ("train.precision=fp8", "train.precision"),
    ("objective.nt_xent.temperature=0", "objective.nt_xent.temperature"),
    ("data.sources=[{name: a}]", "path"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"),
    ("checkpoint.every_minutes=.inf", "checkpoint.every_minutes"),
    ("checkpoint.background=maybe", "checkpoint.background"),
    ("train.micro_batch_size=true", "train.micro_batch_size"),
    ("train.unpadded_attention=flash", "train.unpadded_attention"),
])
def test_bad_values_name_the_dotted_path(override, fragment):
    with pytest.raises(ValueError) as e:
        load_run_config(None, [override])
    assert fragment in str(e.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="key.sub=value"):
        load_run_config(None, ["optim.lr"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_run_config(tmp_path / "list.yaml")


def test_resolved_config_round_trips_through_yaml():
    cfg = load_run_config(REPO / "configs" / "quickstart.yaml", ["objective.nt_xent=null"])
    again = from_dict(RunConfig, yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert to_dict(again)["objective"]["nt_xent"] is None


def test_every_shipped_config_loads():
    """Every run config under configs/ (studies are study files, checked by tests/integration/test_study.py)."""
    files = sorted(f for f in (REPO / "configs").rglob("*.yaml") if "studies" not in f.relative_to(REPO).parts)
    assert len(files) >= 10
    for f in files:
        load_run_config(f)


@pytest.mark.parametrize("preset", ["tiny", "mini", "small", "base", "large"])
def test_model_size_preset_on_the_command_line_resizes_any_recipe(preset):
    """model=NAME takes the size keys of configs/models/NAME.yaml and keeps the recipe's other model keys."""
    want = yaml.safe_load((CONFIGS / "models" / f"{preset}.yaml").read_text())["model"]
    for recipe in sorted((CONFIGS / "recipes").glob("*.yaml")):
        base = load_run_config(str(recipe))
        cfg = load_run_config(str(recipe), [f"model={preset}", "train.max_steps=7"])
        for key, value in want.items():
            assert getattr(cfg.model, key) == value, (recipe.name, key)
        assert cfg.model.pooling == base.model.pooling and cfg.model.dropout == base.model.dropout
        assert cfg.train.max_steps == 7
        if preset != "tiny":  # only tiny has bounds (next test)
            assert cfg.objective == base.objective and cfg.data == base.data and cfg.optim == base.optim


def test_model_tiny_bounds_a_base_recipe_and_what_is_typed_wins(tmp_path):
    """model=tiny lowers lengths, warm-up and batch to tiny scale and raises ArcCSE's every-2-steps intervals;
    values already within the bounds, sections that are off and keys typed on the command line stay."""
    def tiny(name, *more):
        return load_run_config(str(CONFIGS / "recipes" / f"{name}.yaml"), ["model=tiny", *more])

    cfg = tiny("clear_del_span_reorder")
    assert (cfg.data.max_len, cfg.data.view_max_len, cfg.optim.warmup_steps) == (128, 64, 40)
    assert (cfg.train.micro_batch_size, cfg.train.eval_every, cfg.checkpoint.every) == (32, 100, 5000)
    assert cfg.objective.nt_xent.mean_pool_warmup_steps == 80 and cfg.train.max_steps == 500000
    assert {"data.max_len", "optim.warmup_steps"} <= cfg.given
    arc = tiny("arccse_bert_base")
    assert (arc.train.grad_accum, arc.checkpoint.every, arc.eval.stsb_every, arc.objective.triplet.max_len) == (
        1, 100, 100, 64)
    simcse = tiny("simcse_unsup_bert_base")
    assert (simcse.data.view_max_len, simcse.optim.warmup_steps) == (32, 0)  # within the bounds already
    assert simcse.objective.triplet is None
    typed = tiny("clear_del_span", "data.max_len=256", "checkpoint.every=2")
    assert (typed.data.max_len, typed.checkpoint.every, typed.data.view_max_len) == (256, 2, 64)
    # Including the preset from a file takes its model keys, not its bounds.
    (tmp_path / "run.yaml").write_text(f"include: [{CONFIGS / 'models' / 'tiny.yaml'}]\ndata: {{max_len: 512}}\n")
    assert load_run_config(tmp_path / "run.yaml").data.max_len == 512


def test_include_on_the_command_line_merges_in_order(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("model: {hidden_size: 96, num_heads: 3}\noptim: {lr: 0.5}\n")
    b.write_text("model: {hidden_size: 48}\n")
    recipe = str(CONFIGS / "recipes" / "clear_del_span.yaml")
    cfg = load_run_config(recipe, [f"include={a},{b}", "optim.lr=0.25"])
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.optim.lr) == (48, 3, 0.25)
    cfg = load_run_config(recipe, ["optim.lr=0.25", f"include=[{a}]"])  # left to right: the file wins here
    assert cfg.optim.lr == 0.5
    with pytest.raises(ValueError, match="no such size preset; choose one of base, large, mini, modernbert-base, modernbert-large, modernbert-mini, modernbert-tiny, small, tiny"):
        load_run_config(recipe, ["model=huge"])
    with pytest.raises(ValueError, match="no such size preset"):
        load_run_config(recipe, ["model=../recipes/clear_del_span"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_config(recipe, [f"include={tmp_path / 'missing.yaml'}"])


def test_a_mapping_on_the_command_line_merges_like_one_in_a_file(tmp_path):
    """train={micro_batch_size: 64} sets that key only, as the same mapping in an included file does; the section's
    other keys keep the recipe's values (and stay within model=tiny's bounds: only the keys it names are typed)."""
    recipe = str(CONFIGS / "recipes" / "clear_del_span.yaml")
    base = load_run_config(recipe)
    cfg = load_run_config(recipe, ["train={micro_batch_size: 64}"])
    (tmp_path / "f.yaml").write_text(f"include: [{recipe}]\ntrain: {{micro_batch_size: 64}}\n")
    assert cfg == load_run_config(tmp_path / "f.yaml")
    assert (cfg.train.micro_batch_size, cfg.train.max_steps, cfg.train.eval_every) == (64, base.train.max_steps,
                                                                                      base.train.eval_every)
    simcse = str(CONFIGS / "recipes" / "simcse_unsup_bert_base.yaml")
    m = load_run_config(simcse, ["model={hidden_size: 64, num_heads: 2}"]).model
    assert (m.hidden_size, m.num_heads, m.num_layers, m.pooler, m.pooling) == (64, 2, 12, True, "cls")
    tiny = load_run_config(recipe, ["model=tiny", "train={micro_batch_size: 64}"])
    assert (tiny.train.micro_batch_size, tiny.train.eval_every, tiny.train.max_steps) == (64, 100, 500000)
    # null first still resets a section to its defaults
    assert load_run_config(recipe, ["optim=null", "optim={lr: 0.5}"]).optim.warmup_steps == 10000


def test_a_teacher_temperature_listmle_never_reads_is_named(repo_root):
    """RankCSE's tau3 scales ListNet's teacher distribution; ListMLE reads only the teachers' order (its losses are
    equal for any tau3), so a tau3 set with method=listmle is warned; the shipped ListMLE recipe leaves it alone."""
    import torch

    from pretrain.config.lint import inert_settings
    from pretrain.losses.ranking import listmle

    recipe = repo_root / "configs" / "recipes" / "rankcse_listmle_bert_base.yaml"
    warned = [ln for ln in inert_settings(load_run_config(recipe, ["objective.rank_distill.teacher_temperature=0.05"]))
              if "teacher_temperature=0.05 does nothing with method=listmle" in ln]
    assert len(warned) == 1
    assert not [ln for ln in inert_settings(load_run_config(recipe, [])) if "teacher_temperature" in ln]
    listnet = load_run_config(recipe, ["objective.rank_distill.method=listnet",
                                       "objective.rank_distill.teacher_temperature=0.05"])
    assert not [ln for ln in inert_settings(listnet) if "teacher_temperature" in ln]
    student, teacher = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert listmle(student, teacher)[0] == listmle(student, teacher / 0.0125)[0]  # only the order: no tau3 to apply


def test_settings_that_cannot_act_are_named():
    """Each inert setting gets one line naming it and why; the shipped recipes have none (quickstart.yaml's data
    paths, held-out set included, are filled in by pretrain.quickstart)."""
    from pretrain.config.lint import inert_settings

    def lines(overrides, path=None):
        return inert_settings(load_run_config(path, overrides))

    assert lines(["optim.warmup_steps=100"]) == []
    assert any("train.eval_every=5 does nothing" in ln for ln in lines(["train.eval_every=5"]))
    assert lines(["train.eval_every=5", "data.valid=[{name: v, path: /x}]", "optim.warmup_steps=100"]) == []
    got = lines(["data.augment.methods=del-span", "data.augment.subs_rate=0.5", "data.augment.del_span_num=3",
                 "optim.warmup_steps=100"])
    assert len(got) == 1 and "data.augment.subs_rate do nothing" in got[0] and "does not include subs" in got[0]
    assert any("objective.mlm is off" in ln for ln in lines(["objective.mlm=null", "data.masking.prob=0.3"]))
    assert any("eval.pooling do nothing" in ln for ln in lines(["eval.pooling=mean"]))
    assert any("data.sources is not read by data.stage=sentences" in ln
               for ln in lines(["data.stage=sentences", "data.sentences=/s.txt", "data.sources=[{name: a, path: /x}]",
                                "objective.mlm=null", "objective.nt_xent=null", "objective.info_nce={}"]))
    assert any("warming up" in ln for ln in lines(["optim.warmup_steps=50", "train.max_steps=20"]))
    assert any("train.flat_scope=layer does nothing: the parameters are per tensor (train.flat_params=false)" in ln
               for ln in lines(["train.flat_params=false", "train.flat_scope=layer", "optim.warmup_steps=100"]))
    assert lines(["train.flat_scope=layer", "optim.warmup_steps=100"]) == []
    assert any("mean_pool_warmup_steps=50 does nothing" in ln for ln in
               lines(["model.pooling=mean", "objective.nt_xent.mean_pool_warmup_steps=50", "optim.warmup_steps=100"]))
    assert lines(["objective.nt_xent.mean_pool_warmup_steps=50", "optim.warmup_steps=100"]) == []
    assert any("data.masking.span_p do nothing: data.masking.scheme=whole_word" in ln for ln in
               lines(["data.masking.scheme=whole_word", "data.masking.span_p=0.3", "optim.warmup_steps=100"]))
    assert lines(["data.masking.scheme=span", "data.masking.span_p=0.3", "optim.warmup_steps=100"]) == []
    assert any("data.masking.scheme do nothing in data.stage=sentences" in ln
               for ln in lines(["data.stage=sentences", "data.sentences=/s.txt", "data.sources=[]",
                                "data.masking.scheme=span", "optim.warmup_steps=100"]))
    assert any("data.packing=full does nothing in data.stage=sentences" in ln
               for ln in lines(["data.stage=sentences", "data.sentences=/s.txt", "data.sources=[]",
                                "data.packing=full", "optim.warmup_steps=100"]))
    assert lines(["data.packing=full", "optim.warmup_steps=100"]) == []
    assert any("gradient_cache=true changes nothing with train.grad_accum=1" in ln
               for ln in lines(["objective.gradient_cache=true", "optim.warmup_steps=100"]))
    assert any("gradient_cache=true does nothing: no enabled term" in ln
               for ln in lines(["objective.gradient_cache=true", "objective.nt_xent=null", "train.grad_accum=2",
                                "optim.warmup_steps=100"]))
    assert lines(["objective.gradient_cache=true", "train.grad_accum=2", "optim.warmup_steps=100"]) == []
    assert lines(["model=modernbert-base", "optim.warmup_steps=100"]) == []
    assert any("model.norm do nothing with model.arch=modernbert: only model.arch=bert reads them" in ln
               for ln in lines(["model=modernbert-tiny", "model.norm=pre", "optim.warmup_steps=100"]))
    assert any("model.local_window, model.rope_theta do nothing with model.arch=bert" in ln
               for ln in lines(["model.local_window=64", "model.rope_theta=1e4", "optim.warmup_steps=100"]))
    assert any("train.compile_mode do nothing: train.compile=false" in ln
               for ln in lines(["train.compile_mode=reduce-overhead", "optim.warmup_steps=100"]))
    assert lines(["train.compile=true", "optim.warmup_steps=100"]) == []  # unpadded, the fixed layout
    assert any("train.unpadded=true does nothing with train.compile_shapes=static" in ln
               for ln in lines(["train.compile=true", "train.compile_shapes=static", "optim.warmup_steps=100"]))
    assert lines(["train.compile=true", "train.unpadded=false", "optim.warmup_steps=100"]) == []
    assert any("train.unpadded_attention=groups does nothing: the step runs padded (train.unpadded=false)" in ln
               for ln in lines(["train.unpadded=false", "train.unpadded_attention=groups", "optim.warmup_steps=100"]))
    assert lines(["train.unpadded_attention=groups", "optim.warmup_steps=100"]) == []
    graphs = ["train.compile=true", "train.unpadded=false", "train.compile_mode=reduce-overhead",
              "optim.warmup_steps=100"]
    assert any("record one graph per distinct batch shape" in ln for ln in lines(graphs))
    assert lines(graphs + ["train.compile_shapes=bucketed"]) == []
    assert any("train.compile_bucket does nothing without train.compile_shapes=bucketed" in ln
               for ln in lines(["train.compile=true", "train.unpadded=false", "train.compile_bucket=32",
                                "optim.warmup_steps=100"]))
    assert any("train.compile_bucket do nothing: train.compile=false" in ln
               for ln in lines(["train.compile_bucket=32", "optim.warmup_steps=100"]))
    assert any("compiles nothing under objective.gradient_cache" in ln
               for ln in lines(["train.compile=true", "objective.gradient_cache=true", "train.grad_accum=2",
                                "optim.warmup_steps=100"]))
    assert lines(["train.joint_pass=false", "optim.warmup_steps=100"]) == []  # MLM + NT-Xent, unpadded: it acts
    # padded (and so compiled), the two passes are one as well (packing.padded_stream): it acts there too
    assert lines(["train.joint_pass=false", "train.unpadded=false", "optim.warmup_steps=100"]) == []
    assert any("train.joint_pass=false does nothing: the objective does not have both" in ln
               for ln in lines(["train.joint_pass=false", "objective.nt_xent=null", "optim.warmup_steps=100"]))
    for recipe in sorted((CONFIGS / "recipes").glob("*.yaml")) + [CONFIGS / "wiki_books_mini.yaml",
                                                                  CONFIGS / "sentence_stage_quick.yaml"]:
        assert lines([], recipe) == [], recipe.name


def test_precision_auto_is_bf16_only_where_the_device_computes_it_fast():
    import torch

    from pretrain.config.train import resolve_precision

    assert resolve_precision("auto", fast_bf16=True) == "bf16"
    assert resolve_precision("auto", fast_bf16=False) == "fp32"
    assert [resolve_precision(p, fast_bf16=True) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    cfg = load_run_config(str(CONFIGS / "recipes" / "clear_del_span.yaml"))  # the recipes say auto
    assert cfg.train.precision == ("bf16" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
                                   or not torch.cuda.is_available() and _cpu_flag("amx_bf16") else "fp32")
    assert "precision: auto" in (CONFIGS / "recipes" / "simcse_unsup_bert_base.yaml").read_text()


def _cpu_flag(flag: str) -> bool:
    """``flag`` among this machine's CPU flags (Linux), read here independently of pretrain.config.train."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in line.split(":", 1)[-1].split() for line in text.splitlines() if line.startswith("flags"))


def test_a_cpu_computes_bf16_fast_with_amx_bf16_only(tmp_path, monkeypatch):
    """The CPU's flags decide: AMX-BF16 (Sapphire Rapids on) yes; avx512_bf16 alone, AMX's tiles without bf16, a
    flag only as part of another word or outside the flags line, or no /proc/cpuinfo: no. With no GPU, that is what
    precision=auto resolves to."""
    from pretrain.config import train

    def flags(text: str) -> bool:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        return train.cpu_computes_bf16_fast(str(path))

    line = "flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16"
    assert flags(f"processor\t: 0\n{line} amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n{line} amx_bf16\n")
    assert not flags(f"processor\t: 0\n{line}\n")
    assert not flags(f"{line} amx_tile amx_int8\n")
    assert not flags(f"{line} xamx_bf16\nmodel name\t: amx_bf16\n")
    assert not train.cpu_computes_bf16_fast(str(tmp_path / "absent"))
    assert train.cpu_computes_bf16_fast() == _cpu_flag("amx_bf16")
    monkeypatch.setattr(train, "CPUINFO", str(tmp_path / "cpuinfo"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for text, expected in ((f"{line} amx_bf16\n", "bf16"), (f"{line}\n", "fp32")):
        (tmp_path / "cpuinfo").write_text(text)
        assert train.resolve_precision("auto") == expected


def test_an_empty_data_path_names_its_key(capsys):
    """configs/quickstart.yaml without the quickstart's data: the error names data.tokenizer and data.sources and
    says how to get them, before anything is built (exit 2)."""
    from pretrain.train import main

    assert main([str(CONFIGS / "quickstart.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain-train: error: data.tokenizer is empty") and "data.sources is empty" in err
    assert "--prepare-only" in err and err.count("\n") == 1


def test_null_for_a_string_key_names_the_empty_string_that_unsets_it():
    """checkpoint.init_from=null (how one would unset a recipe's init_from) is refused with the spelling that works;
    that spelling then starts from scratch."""
    with pytest.raises(ValueError, match=r"expected a string, got NoneType None; to leave it unset, give an empty "
                                         r"string: checkpoint.init_from=''"):
        load_run_config(None, ["checkpoint.init_from=null"])
    with pytest.raises(ValueError, match=r"expected a string, got int 3$"):
        load_run_config(None, ["checkpoint.init_from=3"])
    assert load_run_config(None, ["checkpoint.init_from=some/dir", "checkpoint.init_from=''"]).checkpoint.init_from == ""


def test_the_unpadded_attention_layout_is_groups_by_default_and_varlen_refused_for_modernbert():
    train = load_run_config(None, []).train
    assert [train.unpadded_layout(arch) for arch in ("bert", "modernbert")] == ["groups", "groups"]
    assert load_run_config(None, ["train.unpadded_attention=groups"]).train.unpadded_layout("bert") == "groups"
    assert load_run_config(None, ["train.unpadded_attention=varlen"]).train.unpadded_layout("bert") == "varlen"
    assert load_run_config(None, ["train.unpadded=false"]).train.unpadded_layout("bert") is False
    assert load_run_config(None, ["train.compile=true"]).train.unpadded_layout("bert") == "fixed"
    assert load_run_config(None, ["train.compile=true"]).train.unpadded_layout("modernbert") == "fixed"
    assert load_run_config(None, ["train.unpadded_attention=fixed"]).train.unpadded_layout("bert") == "fixed"
    for shapes in ("static", "bucketed"):
        assert load_run_config(None, ["train.compile=true", f"train.compile_shapes={shapes}"]).train.unpadded_layout(
            "bert") is False
    for layout in ("groups", "varlen"):
        with pytest.raises(ValueError, match=f"train.unpadded_attention={layout} with train.compile=true"):
            load_run_config(None, ["train.compile=true", f"train.unpadded_attention={layout}"]).train.unpadded_layout(
                "bert")
    with pytest.raises(ValueError, match="train.unpadded_attention=varlen is for model.arch=bert"):
        load_run_config(str(CONFIGS / "models" / "modernbert-tiny.yaml"), ["train.unpadded_attention=varlen"])


def test_first_last_avg_pooling_is_refused_where_training_embeds_sentences():
    """model.pooling=first_last_avg (SimCSE's evaluation pooling: layer 1 and layer L) is not what the training step
    pools; with a term that embeds sentences the config is refused at load, naming the terms and what to set (it
    used to pass and fail at the first step, after the whole set-up, with "call encode(..., all_layers=True)").
    MLM alone never pools: accepted, and so is first_last_avg for evaluation."""
    with pytest.raises(ValueError, match=r"model.pooling=first_last_avg .* objective.nt_xent does: set model.pooling "
                                         r"to cls, cls_before_pooler or mean, and evaluate with eval.pooling"):
        load_run_config(None, ["model.pooling=first_last_avg"])
    with pytest.raises(ValueError, match=r"objective.nt_xent, objective.info_nce do:"):
        load_run_config(None, ["model.pooling=first_last_avg", "objective.info_nce={weight: 1.0}"])
    assert load_run_config(None, ["model.pooling=first_last_avg", "objective.nt_xent=null"]).model.pooling \
        == "first_last_avg"
    assert load_run_config(None, ["model.pooling=mean", "eval.pooling=first_last_avg"]).eval.pooling == "first_last_avg"


def test_views_without_a_deletion_warn_as_clears_authors_found_them():
    """CLEAR (section 4.2): MLM + subs, + reorder and + subs+reorder converged at once or exploded; nothing said so
    to a user who chose them. A deletion among the methods, or no contrastive term, gets no such line."""
    from pretrain.config.lint import inert_settings

    def warned(methods, *more):
        lines = inert_settings(load_run_config(None, [f"data.augment.methods={methods}", *more]))
        return any("without a deletion" in line for line in lines)

    assert warned("subs") and warned("reorder") and warned("subs+reorder")
    assert not warned("del-span+reorder") and not warned("del-word+reorder") and not warned("none")
    assert not warned("reorder", "objective.nt_xent=null")


def test_a_run_that_evaluates_another_pooling_than_it_trains_is_warned(repo_root):
    """The SimCSE/ArcCSE/RankCSE headers said to add model.pooling=mean for the quickstart's mean-pooled checkpoint;
    a user who did trained a mean-pooled embedding while eval.pooling=cls_before_pooler selected best/, evaluated
    and exported [CLS] (STS-B 73.6 against 82.4 with mean pooling), and nothing said so. Now the start-up lines do,
    the headers name eval.pooling=mean too, and SimCSE's own pair ([CLS] through the pooler in training, before it
    at test) and runs without a contrastive term stay quiet."""
    import re

    from pretrain.config.lint import inert_settings

    def warned(recipe, *overrides):
        path = repo_root / "configs" / "recipes" / f"{recipe}.yaml" if recipe else None
        return [ln for ln in inert_settings(load_run_config(path, list(overrides))) if "evaluates a" in ln]

    for recipe in ("simcse_unsup_bert_base", "simcse_sup_bert_base", "arccse_bert_base",
                   "rankcse_listnet_bert_base", "rankcse_listmle_bert_base"):
        got = warned(recipe, "model.pooling=mean")
        assert len(got) == 1 and "while the contrastive terms train a mean-pooled one" in got[0], (recipe, got)
        assert "set eval.pooling=mean" in got[0]
        header = (repo_root / "configs" / "recipes" / f"{recipe}.yaml").read_text()
        advice = re.search(r"add (model\.pooling=mean[^)]*)\)", header).group(1).split()
        assert warned(recipe, *advice) == [], (recipe, advice)  # what the header says to add is consistent
        assert warned(recipe) == []  # SimCSE's [CLS] with / without the pooler
    assert warned(None, "model.pooling=cls", "eval.pooling=mean")  # the other way round
    assert warned(None, "model.pooling=mean") == []  # evaluates what it trains
    assert warned(None, "model.pooling=mean", "eval.pooling=cls", "objective.nt_xent=null") == []  # MLM only
