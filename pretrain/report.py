"""``pretrain-report``: PNG plots and a markdown summary of one or more run directories.

    pretrain-report runs/clear runs/simcse --out reports/clear-vs-simcse

Reads each run's ``metrics.jsonl`` (the records ``metrics.writer.MetricsWriter`` writes: ``split`` train, valid,
eval, or rollback: one per rollback past a loss spike, drawn as a dashed line on the training plots and listed),
its ``config.yaml`` and its newest checkpoint's ``trainer_state.json``. Writes one PNG per metric with
every run overlaid (one colour per run) and ``report.md`` embedding them, beside a table of each run's
config highlights and results. Plots are drawn on matplotlib's Agg canvas: no display, no pyplot state.

The records are read into numpy columns (``metrics/history.py``; 1e6 records: docs/operations.md, "The report of a
long run"). A line is drawn through at most MAX_POINTS points (``decimate``: each stretch's first, last, lowest and
highest value and its first NaN, so a spike or a NaN step stays drawn); the tables are computed from every record.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.checkpoint import store
from pretrain.checkpoint.store import CheckpointError, checkpoints_dir, find_latest
from pretrain.export.resolve import best_record, format_best_score, select_checkpoint
from pretrain.metrics.history import ROLLBACK, Records, read_metrics

LOSS_TERMS = ("mlm", "nt_xent", "info_nce", "arccon", "triplet", "consistency", "rank_distill", "reconstruction")
"""The loss terms a run can log, as named in ``objective.terms.OBJECTIVES`` (a test keeps the two equal)."""


@dataclass(frozen=True)
class Plot:
    file: str
    """PNG name inside the report directory."""
    split: str
    """Which records hold the metric: train, valid (held-out) or eval (STS-B dev)."""
    metric: str
    title: str
    log_y: bool = False


PLOTS = (
    Plot("train_loss.png", "train", "loss", "Training loss (weighted sum of the terms)"),
    *(Plot(f"train_{t}.png", "train", t, f"Training loss term: {t}") for t in LOSS_TERMS),
    *(Plot(f"train_{k}.png", "train", k, f"Collapse watch: mean cosine between different sentences' embeddings ({k})")
      for k in ("cl_emb_cos", "info_nce_emb_cos", "arccon_emb_cos")),
    Plot("lr.png", "train", "lr", "Learning rate"),
    Plot("grad_norm.png", "train", "grad_norm", "Gradient norm"),
    Plot("loss_scale.png", "train", "loss_scale", "Loss scale (fp16 dynamic scaling; 1 otherwise)", log_y=True),
    Plot("tokens_per_s.png", "train", "tokens_per_s", "Throughput (tokens/s, all ranks)"),
    Plot("valid_mlm.png", "valid", "mlm", "Held-out MLM loss"),
    Plot("valid_mlm_acc.png", "valid", "mlm_acc", "Held-out MLM accuracy"),
    Plot("valid_cl_acc.png", "valid", "cl_acc", "Held-out contrastive top-1 accuracy"),
    Plot("stsb_dev.png", "eval", "stsb_dev_spearman", "STS-B dev Spearman x100"),
)

TRAIN_KEYS = {p.metric for p in PLOTS if p.split == "train"} | {"time", "tokens_seen"}
"""The keys of train records the report reads (plots, wall time, tokens seen): the only ones kept in memory."""

MAX_POINTS = 4000
"""Points a plot's line is drawn through at most (``decimate``); the plot is ~600 pixels wide."""

AGG_CHUNK = 1000
"""Points Agg rasterizes at a time (rcParam agg.path.chunksize): a jagged 4,000-point line in one piece held ~20 MB
of rasterizer cells (a dozen pixels of 280k drawn differently)."""


@dataclass
class Run:
    """One run directory: its metrics records by split (step order; of train records only TRAIN_KEYS), config,
    newest trainer state, notes."""

    name: str
    path: Path
    records: dict[str, Records]
    config: dict | None = None
    state: dict | None = None
    notes: list[str] = field(default_factory=list)
    checkpoint: str = ""
    """The line a reader of this run prints (``select_checkpoint``): the latest tag and step, best/ if it differs."""

    def series(self, split: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps (M,) int64, values (M,) float64) of the M records of ``split`` where ``metric`` is a number."""
        records = self.records.get(split)
        return records.series(metric) if records else (np.zeros(0, np.int64), np.zeros(0))

    def last(self, split: str, metric: str | None = None) -> dict | None:
        records = self.records.get(split)
        return records.last(metric) if records else None


# ------------------------------------------------------------------------------------------------ reading

def load_run(run_dir: str | Path, name: str) -> Run:
    """FileNotFoundError (naming the directory) when it is missing or has no metrics.jsonl."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory (give run directories, e.g. runs/quickstart)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run directory, or its run has not "
                                f"logged a step yet")
    records, notes = read_metrics(metrics, keys={"train": TRAIN_KEYS})
    run = Run(name=name, path=path, records=records, notes=notes)
    if not any(records.values()):
        run.notes.append(f"{metrics}: no metrics records yet")
    config = path / "config.yaml"
    if config.is_file():
        import yaml

        try:
            loaded = yaml.safe_load(config.read_text(encoding="utf-8"))
            run.config = loaded if isinstance(loaded, dict) else None
        except yaml.YAMLError as e:
            run.notes.append(f"{config} is not readable YAML ({str(e).splitlines()[0]}); no config highlights")
    else:
        run.notes.append(f"{path}: no config.yaml; no config highlights")
    run.state = _newest_trainer_state(path, run.notes)
    run.checkpoint = _checkpoint_line(path)
    return run


def _checkpoint_cell(run: Run) -> str:
    """The newest checkpoint's tag and step, and best/ (step, STS-B dev) when it is another step."""

    tag = find_latest(checkpoints_dir(run.path)) if checkpoints_dir(run.path).is_dir() else None
    cell = f"{tag} (step {(run.state or {}).get('step', '?')})" if tag else "none"
    best = best_record(run.path)
    if best is not None and best.get("step") != (run.state or {}).get("step"):
        cell += f"; best/ step {best.get('step')} (STS-B dev {format_best_score(best)})"
    return cell


def _checkpoint_line(run_dir: Path) -> str:
    """select_checkpoint's line for the run's newest checkpoint ("" when it has none yet)."""

    if not checkpoints_dir(run_dir).is_dir() and not (run_dir / "best").is_dir():
        return ""  # select_checkpoint would describe the run directory itself as weights ("(unrecognised)")
    try:  # a damaged newest checkpoint's warning goes to stderr, not into the report
        _, line = select_checkpoint(run_dir, say=lambda text: print(text, file=sys.stderr, flush=True))
    except (CheckpointError, FileNotFoundError, ValueError):
        return ""
    return line.replace("reading ", "", 1)


def _newest_trainer_state(run_dir: Path, notes: list[str]) -> dict | None:
    try:
        return store.latest_trainer_state(run_dir)
    except store.CheckpointError as e:
        notes.append(f"{run_dir}: {e}")
        return None


def run_names(run_dirs: list[str]) -> list[str]:
    """Each directory's name; the path as given where two names would be the same."""
    names = [Path(d).resolve().name or str(d) for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


# ------------------------------------------------------------------------------------------------ plotting

def _style(i: int) -> dict:
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


FLOAT32_MAX = 3.4028234663852886e38
"""TensorBoard keeps float32: a value beyond this is inf there; near float64's end matplotlib cannot draw an axis."""


def _label(name: str) -> str:
    """A run name as matplotlib's text shows it as written: ``$`` would start mathtext (``\\foo`` an error)."""
    return name.replace("$", r"\$")


def new_figure():
    """A 7 x 4 inch matplotlib Figure on an Agg canvas. A report draws every plot on one: each figure is a reference
    cycle whose renderer holds its rasterizer's cells (~25 MB for a jagged 4,000-point line) until Python's cycle
    collector comes, so a figure per plot made the memory grow plot by plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def draw(plot: Plot, runs: list[Run], path: Path, fig=None) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """Draws ``plot`` into the PNG ``path`` (on ``fig``, cleared, when given); returns ``figure``'s names of runs
    without the metric and values not drawn."""
    import matplotlib

    fig, missing, undrawn = figure(plot, runs, fig)
    with matplotlib.rc_context({"agg.path.chunksize": AGG_CHUNK}):
        fig.savefig(path, format="png")
    return missing, undrawn


def figure(plot: Plot, runs: list[Run], fig=None):
    """(matplotlib Figure of ``plot`` with every run that has the metric, run i in colour Ci; the names of those
    without; per run the values not drawn — NaN, inf, beyond float32: gaps in the curve — as (how many, first
    step)). ``fig``: a ``new_figure`` to clear and draw on (a new one when not given)."""
    fig = new_figure() if fig is None else fig
    fig.clear()
    ax = fig.add_subplot()
    missing, lows, highs, undrawn, handles = [], [], [], {}, []
    for i, run in enumerate(runs):
        steps, values = run.series(plot.split, plot.metric)
        if not len(steps):
            missing.append(run.name)
            continue
        drawn = (values >= -FLOAT32_MAX) & (values <= FLOAT32_MAX)
        if not drawn.all():
            gaps = np.flatnonzero(~drawn)
            undrawn[run.name] = (len(gaps), int(steps[gaps[0]]))
            values = np.where(drawn, values, np.nan)
        few = len(steps) <= 40 or plot.split != "train"
        handles += ax.plot(*decimate(steps, values), label=_label(run.name), marker="o" if few else None,
                           markersize=3, linewidth=1.5, **_style(i))
        if drawn.any():
            lows.append(np.min(values, where=drawn, initial=np.inf))
            highs.append(np.max(values, where=drawn, initial=-np.inf))
        if plot.split == "train":  # each rollback: a dashed line at the step whose loss (or bad steps) triggered it
            for k, rb in enumerate(run.records.get(ROLLBACK, [])):
                line = ax.axvline(rb.get("trigger_step", rb["step"]), color=_style(i)["color"], linestyle="--",
                                  linewidth=1.0, alpha=0.7, label=f"{_label(run.name)}: rollback")
                handles += [line] if k == 0 else []
    if plot.log_y and lows and min(lows) > 0 and max(highs) / min(lows) > 10:
        ax.set_yscale("log")
    ax.set_title(plot.title)
    ax.set_xlabel("step")
    ax.set_ylabel(plot.metric)
    ax.grid(alpha=0.3)
    # The handles named: a label starting with "_" (a run directory "_base") would be left out of the legend.
    ax.legend(handles, [h.get_label() for h in handles], loc="best", fontsize="small")
    fig.tight_layout()
    return fig, missing, undrawn


def decimate(steps: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values), both (N,), thinned to at most ``max_points`` points for a line: cut into max_points // 5
    stretches of consecutive points, each keeps its first, last, lowest and highest point and its first NaN (a gap
    in the line), so a loss spike or a single NaN step is still drawn. Up to ``max_points`` points come back as
    they are."""
    assert max_points >= 10, max_points
    n = len(steps)
    if n <= max_points:
        return steps, values
    stretches = max_points // 5 - 1  # and one more with the rest
    width = n // stretches
    body = stretches * width
    picks = [_extremes(values[:body].reshape(stretches, width))]
    if body < n:
        picks.append(body + _extremes(values[body:].reshape(1, n - body)))
    picks = np.unique(np.concatenate(picks))  # in step order
    return steps[picks], values[picks]


def _extremes(grid: np.ndarray) -> np.ndarray:
    """Indices into ``grid`` (S, W) flattened of each row's first, last, lowest and highest point and first NaN."""
    num_rows, width = grid.shape
    starts = np.arange(num_rows) * width
    nan = np.isnan(grid)
    gaps = nan.any(1)
    low, high = grid.argmin(1), grid.argmax(1)  # a row with a NaN gives its first NaN: redone without them
    if gaps.any():
        rows = grid[gaps]
        low[gaps] = np.where(nan[gaps], np.inf, rows).argmin(1)
        high[gaps] = np.where(nan[gaps], -np.inf, rows).argmax(1)
    return np.concatenate([starts, starts + width - 1, starts + low, starts + high, (starts + nan.argmax(1))[gaps]])


# ------------------------------------------------------------------------------------------------ summary

def config_highlights(run: Run) -> dict[str, str]:
    """Model size, objectives and weights, augmentation, global batch, lr, precision, ZeRO stage."""
    c = run.config or {}
    model, data, optim, train = (c.get(k) or {} for k in ("model", "data", "optim", "train"))
    rows = {"model": (f"hidden {model.get('hidden_size', '?')}, {model.get('num_layers', '?')} layers, "
                      f"{model.get('num_heads', '?')} heads (ffn {model.get('ffn_size', '?')}, "
                      f"vocab {model.get('vocab_size', '?')})") if model else "?"}
    terms = []
    for name, sub in (c.get("objective") or {}).items():
        if isinstance(sub, dict):
            extra = [f"τ {sub['temperature']:g}"] if isinstance(sub.get("temperature"), (int, float)) else []
            if isinstance(sub.get("positive_weight"), (int, float)):
                extra.append(f"positive ×{sub['positive_weight']:g}")
            terms.append(f"{name} ×{_g(sub.get('weight'))}" + (f" ({', '.join(extra)})" if extra else ""))
    rows["objectives"] = " + ".join(terms) or "?"
    stage = data.get("stage", "pretrain")
    rows["augmentation"] = ((data.get("augment") or {}).get("methods", "?") if stage == "pretrain"
                            else f"none (data.stage={stage})")
    micro, accum = train.get("micro_batch_size", "?"), train.get("grad_accum", 1)
    if run.state and "global_batch" in run.state:
        s = run.state
        ranks = s.get("world_size", "?")
        rows["global batch"] = (f"{s['global_batch']} ({ranks} rank{'' if ranks == 1 else 's'} × "
                                f"{s.get('micro_batch_size', micro)} × {s.get('grad_accum', accum)} accum)")
    else:
        rows["global batch"] = f"{micro} × {accum} accum per rank (no checkpoint gives the rank count)"
    rows["lr"] = (f"{_g(optim.get('lr'))}, {optim.get('schedule', '?')}, {optim.get('warmup_steps', '?')} warmup "
                  f"steps") if optim else "?"
    rows["precision"] = str(train.get("precision", "?"))
    rows["ZeRO stage"] = str((c.get("distributed") or {}).get("zero_stage", "?"))
    return rows


def results(run: Run) -> dict[str, str]:
    """Steps, tokens seen, wall time, best STS-B dev (and its step), the last held-out figures."""
    c = run.config or {}
    max_steps = (c.get("train") or {}).get("max_steps")
    last_train = run.last("train")
    step = last_train["step"] if last_train else 0
    rows = {"steps": f"{step}" + (f" / {max_steps}" if max_steps else "")}
    rows["checkpoint"] = _checkpoint_cell(run)
    tokens = run.last("train", "tokens_seen")
    rows["tokens seen"] = _count(tokens["tokens_seen"]) if tokens else "—"
    times = np.concatenate([np.zeros(0)] + [records.series("time")[1] for records in run.records.values()])
    times = times[np.isfinite(times)]
    rows["wall time"] = _duration(float(times.max() - times.min())) if len(times) > 1 else "—"
    steps, scores = run.series("eval", "stsb_dev_spearman")
    scored = np.isfinite(scores)
    if scored.any():
        best = np.argmax(np.where(scored, scores, -np.inf))  # the first step with the best score
        rows["best STS-B dev"] = f"{scores[best]:.2f} (step {steps[best]})"
    else:
        rows["best STS-B dev"] = "—"
    rows["rollbacks"] = str(len(run.records.get(ROLLBACK, [])))
    held = run.last("valid")
    if held:
        figures = [f"{k} {_g(v, 4)}" for k, v in sorted(held.items())
                   if k not in ("step", "split", "time") and isinstance(v, (int, float))]
        rows["held-out (last)"] = f"step {held['step']}: " + ", ".join(figures)
    else:
        rows["held-out (last)"] = "—"
    return rows


def _g(v, digits: int = 3) -> str:
    return f"{v:.{digits}g}" if isinstance(v, (int, float)) else "?"


def _count(n) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{int(n):,}"


def _duration(seconds: float) -> str:
    s = round(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(runs: list[Run], rows_by_run: list[dict[str, str]]) -> list[str]:
    lines = ["| | " + " | ".join(f"**{_cell(r.name)}**" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for key in rows_by_run[0]:
        lines.append(f"| {key} | " + " | ".join(_cell(rows[key]) for rows in rows_by_run) + " |")
    return lines


def rollback_section(runs: list[Run]) -> list[str]:
    """The "Rollbacks" table (none: no lines): each rollback's trigger, where the run went back to, what it skipped."""
    rows = [(run, rb) for run in runs for rb in run.records.get(ROLLBACK, [])]
    if not rows:
        return []
    md = ["## Rollbacks", "", "Each is a dashed line on the training plots (training/spikes.py; docs/operations.md, "
          "\"Loss spikes\").", "",
          "| run | trigger step | reason | back to step | skipped samples | retry | what was seen |",
          "|---|---|---|---|---|---|---|"]
    for run, rb in rows:
        skipped = rb.get("skipped_samples")
        span = f"{skipped[0]}-{skipped[1] - 1}" if isinstance(skipped, list) and len(skipped) == 2 else "?"
        md.append(f"| {_cell(run.name)} | {rb.get('trigger_step', '?')} | {_cell(rb.get('reason', '?'))} | "
                  f"{rb['step']} | {span} | {rb.get('retry', '?')} | {_cell(rb.get('detail', ''))} |")
    return md + [""]


# ------------------------------------------------------------------------------------------------ the report

@dataclass
class Report:
    markdown: Path
    images: list[Path]
    absent: list[Plot]
    notes: list[str]
    checkpoints: dict[str, str] = field(default_factory=dict)
    """run directory -> the checkpoint line a reader of it prints."""


def write_report(run_dirs: list[str], out_dir: str | Path) -> Report:
    """Plots and ``report.md`` for ``run_dirs`` in ``out_dir``; FileNotFoundError for a bad run directory."""
    runs = [load_run(d, name) for d, name in zip(run_dirs, run_names(run_dirs))]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, absent, sections, fig = [], [], [], new_figure()
    for plot in PLOTS:
        if not any(len(run.series(plot.split, plot.metric)[0]) for run in runs):
            absent.append(plot)
            continue
        missing, undrawn = draw(plot, runs, out / plot.file, fig)
        images.append(out / plot.file)
        sections += [f"### {plot.title}", "", f"![{plot.title}]({plot.file})", ""]
        if missing:
            sections += [f"_Not logged by: {', '.join(missing)}._", ""]
        if undrawn:
            sections += ["_Not drawn (NaN, inf or beyond float32; TensorBoard shows them as NaN/inf): "
                         + "; ".join(f"{_cell(name)}: {n} value(s), the first at step {first}"
                                     for name, (n, first) in undrawn.items()) + "._", ""]
    notes = [note for run in runs for note in run.notes]
    md = ["# Training report", "",
          f"{len(runs)} run(s): " + ", ".join(f"**{r.name}** (`{r.path}`)" for r in runs) + ".", "",
          "## Configuration", "", *_table(runs, [config_highlights(r) for r in runs]), "",
          "## Results", "", *_table(runs, [results(r) for r in runs]), "",
          ("Wall time runs from the first to the last metrics record (any pause between launches included); "
           "tokens seen counts every rank's input tokens; held-out figures are the last validation record."), "",
          "## Plots", "", "One colour per run, the same in every plot.", "", *sections]
    md += rollback_section(runs)
    if absent:
        md += ["## Absent metrics", "", "Logged by no run, so not plotted: "
               + ", ".join(f"{p.title} (`{p.split}/{p.metric}`)" for p in absent) + ".", ""]
    if notes:
        md += ["## Notes", "", *(f"- {_cell(n)}" for n in notes), ""]
    markdown = out / "report.md"
    markdown.write_text("\n".join(md), encoding="utf-8")
    return Report(markdown=markdown, images=images, absent=absent, notes=notes,
                  checkpoints={str(r.path): r.checkpoint for r in runs})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pretrain-report", description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", required=True, help="output directory for the PNGs and report.md")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("pretrain-report: error: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    try:
        report = write_report(args.run_dirs, args.out)
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        print(f"pretrain-report: error: {e}", file=sys.stderr)
        return 2
    for run_dir, line in report.checkpoints.items():
        print(f"{run_dir}: {line or 'no checkpoint yet (figures from metrics.jsonl)'}")
    for note in report.notes:
        print(f"note: {note}")
    absent = ", ".join(f"{plot.split}/{plot.metric}" for plot in report.absent)
    print(f"wrote {report.markdown} with {len(report.images)} plots"
          + (f"; absent from every run: {absent}" if absent else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
