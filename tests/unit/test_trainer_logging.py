"""What the trainer tells the user while it runs."""

from __future__ import annotations


def test_data_starvation_warns_once():
    """A warning, once, when the step waits for data more than 10% of the time (not in the first window)."""
    from pretrain.training.progress import DATA_WAIT_WARN, StarvationWatch

    watch = StarvationWatch(log_every=10, num_workers=1)
    assert watch.update(10, 0.5) is None  # the first log window (worker start-up): no warning
    assert watch.update(20, DATA_WAIT_WARN / 2) is None
    warning = watch.update(20, 0.42)
    assert warning.startswith("warning: step 20 waited for data 42% of the time") and "data.num_workers (now 1)" in warning
    assert watch.update(30, 0.9) is None


def test_console_line_shows_every_objective_figure_and_the_time_left():
    from pretrain.metrics.writer import format_duration, format_progress

    scalars = {"step": 40, "split": "train", "time": 1.0, "loss": 2.5, "info_nce": 2.25, "pos_cos": 0.8125,
               "neg_cos": 0.125, "acc": 0.75, "lr": 3e-5, "grad_norm": 1.5, "loss_scale": 1.0, "bad_steps": 0,
               "samples_per_s": 1234.4, "tokens_per_s": 45678.9, "tokens_seen": 99, "data_wait_frac": 0.034}
    line = format_progress(40, 100, scalars, eta_s=3725)
    assert line == ("step 40/100 | loss 2.5 | info_nce 2.25 | pos_cos 0.8125 | neg_cos 0.125 | acc 0.75 | lr 3e-05 | "
                    "grad_norm 1.5 | samples_per_s 1,234 | tokens_per_s 45,679 | data_wait 3.4% | eta 1h02m")
    assert "loss_scale 512" in format_progress(1, 2, {**scalars, "loss_scale": 512.0, "bad_steps": 1})
    assert (format_duration(95), format_duration(4), format_duration(-3)) == ("1m35s", "4s", "0s")


def test_chance_losses_and_the_collapse_warning():
    """NT-Xent's chance loss is ln(2m - 1) over the gathered batch (the whole step's under objective.gradient_cache),
    InfoNCE's ln(m); the warning comes once, after COLLAPSE_PATIENCE steps at chance, and a step away from chance
    restarts the count."""
    import math

    from pretrain.config import load_run_config
    from pretrain.training.progress import CollapseWatch, chance_losses

    cfg = load_run_config(None, ["train.micro_batch_size=32", "model.pooling=cls"])
    assert chance_losses(cfg, 2) == {"nt_xent": math.log(127)}
    assert chance_losses(load_run_config(None, ["train.micro_batch_size=32", "objective.nt_xent.gather=false"]),
                         2) == {"nt_xent": math.log(63)}
    sent = load_run_config(None, ["train.micro_batch_size=8", "objective.nt_xent=null", "objective.mlm=null",
                                  "objective.info_nce={}"])
    assert chance_losses(sent, 4) == {"info_nce": math.log(32)}
    # Under the gradient cache a term compares the whole step's micro-batches (it used to count one of them).
    cached = ["train.micro_batch_size=32", "train.grad_accum=4", "objective.gradient_cache=true"]
    assert chance_losses(load_run_config(None, cached), 1) == {"nt_xent": math.log(255)}
    assert chance_losses(load_run_config(None, cached[:2]), 1) == {"nt_xent": math.log(63)}
    watch = CollapseWatch(cfg, 2, patience=200)
    at_chance = {"nt_xent": math.log(127) * 1.01, "cl_emb_cos": 0.9999}
    assert watch.update(10, at_chance) == [] and watch.update(150, at_chance) == []
    assert watch.update(160, {"nt_xent": 2.0}) == []  # escaped: the count restarts
    assert watch.update(170, at_chance) == [] and watch.update(360, at_chance) == []
    warned = watch.update(370, at_chance)
    assert len(warned) == 1 and "since step 170 (200 steps)" in warned[0] and "0.9999" in warned[0]
    assert "model.pooling=mean" in warned[0] and "[CLS]" in warned[0]
    assert "objective.nt_xent.mean_pool_warmup_steps=200" in warned[0]
    assert watch.update(380, at_chance) == []  # once


def test_resume_schedule_change_names_both_learning_rates():
    from pretrain.config import load_run_config, to_dict
    from pretrain.training.optim import lr_lambda
    from pretrain.training.progress import schedule_change

    old = load_run_config(None, ["train.max_steps=40", "optim.warmup_steps=10", "optim.lr=1e-3"])
    new = load_run_config(None, ["train.max_steps=80", "optim.warmup_steps=10", "optim.lr=1e-3"])
    assert schedule_change(to_dict(old), old, 40) is None
    note = schedule_change(to_dict(old), new, 40)
    want_old = 1e-3 * lr_lambda(old.optim, 40)(40)
    want_new = 1e-3 * lr_lambda(new.optim, 80)(40)
    assert "train.max_steps 40 -> 80" in note and f"was {want_old:.3g}" in note and f"is {want_new:.3g} now" in note


def test_a_run_prints_banner_first_step_eta_and_summary(tmp_path, tiny_overrides, clean_env, capsys):
    """The console of a real tiny run: the banner, a line at step 1 (without the time left: that step holds the
    start-up), the time left at the next line, the end summary; a resume with more steps says how the LR schedule
    changes."""
    from pretrain.train import main

    run = tmp_path / "run"
    assert main([*tiny_overrides(run), "train.max_steps=3", "train.log_every=10", "optim.warmup_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "parameters (encoder.embeddings" in out and "memory per rank" in out
    first = [ln for ln in out.splitlines() if ln.startswith("step 1/3")]
    assert first and "| eta " not in first[0]
    assert [ln for ln in out.splitlines() if ln.startswith("step 3/3") and ln.endswith("| eta 0s")]
    assert "done: step 3/3 (3 in this launch" in out and "held-out at the end: " in out
    assert f"artifacts in {run}" in out and "model.safetensors" in out
    # A second in-process run: the first one's main put back the launcher variables and its group's end left
    # nothing of DeepSpeed's behind (distributed.env), so it starts afresh.
    assert main([*tiny_overrides(run), "train.max_steps=5", "train.log_every=10", "optim.warmup_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "resuming at step 3 with train.max_steps 3 -> 5" in out and "step 4/5" in out
