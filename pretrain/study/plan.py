"""The study file of ``pretrain-study`` and the plan made from it: steps with resolved commands and dependencies.

A study file (``configs/studies/*.yaml``) has these top-level keys::

    name: clear_small                  # the study's name (default: the file's stem)
    out: runs/studies/clear_small      # its directory (--out overrides; default runs/studies/NAME)
    env: {OMP_NUM_THREADS: "2"}        # added to every step's environment (ENV_KEYS; PRETRAIN_DATA_DIR is always set)
    uses: {clear_small: configs/studies/clear_small.yaml}   # other studies whose results this one reads
    prep:                              # run once each, in order; done when OUTPUT (or OUTPUT/COMPLETE) exists
      - {name: tokenizer, output: prep/tokenizer.json, command: [pretrain-tokenizer, ..., --out, "{output}"]}
                                       # a command is one of pretrain's own CLIs (TOOLS): a study file runs no other
    shared:
      overrides: [model=tiny, train.max_steps=600, ...]   # every arm gets these, after its base config
      equal: [train.max_steps, ...]    # resolved keys that must come out equal in every arm (checked first)
    arms:                              # base config + the arm's own overrides + seeds; a run = arm x seed
      - {name: mlm, config: configs/recipes/clear_del_span.yaml, overrides: [objective.nt_xent=null], seeds: [1]}
    evaluations:
      weights: final | best            # the run directory, or <run_dir>/best (STS-B dev keep-best)
      runs: [{name: sts, tool: pretrain-eval | pretrain-finetune-glue, args: [...]}]   # every run, the same
    tables: [{kind: sts | glue | align | training | report, title: ..., evals: [sts], convention: all, arms: [...]}]

An arm may not set a key the shared overrides set unless it lists it under ``replaces_shared`` (a remedy arm that
is meant to differ there). Strings may hold the placeholders of ``PLACEHOLDER``; ``{run:ARM}`` and friends make
the run depend on ARM's run. ``Planner`` turns the file into ``Step``s in dependency order: prep, then per run
its training and its evaluations, then the report. Nothing here runs anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.config import load_run_config, to_dict

TOOLS = {
    "pretrain-tokenizer": "pretrain.prep.tokenizer",
    "pretrain-preprocess": "pretrain.prep.preprocess",
    "pretrain-train": "pretrain.train",
    "pretrain-convert": "pretrain.export.convert",
    "pretrain-eval": "pretrain.eval.cli",
    "pretrain-finetune-glue": "pretrain.eval.glue_cli",
    "pretrain-report": "pretrain.report",
}
"""Console scripts the driver runs as ``sys.executable -m MODULE`` (the same interpreter, with or without PATH)."""

EVAL_RESULTS = {"pretrain-eval": "eval.json", "pretrain-finetune-glue": "results.json"}
"""The file an evaluation tool writes last into its --out directory: the evaluation is done when it exists."""

PLACEHOLDER = re.compile(r"\{(data|out|seed|output)\}|\{(prep|run|best|runs|bests):([A-Za-z0-9_.\-/]+)\}")
"""{data} shared data root, {out} the study's directory, {seed} the run's seed, {output} a preparation step's
output; {prep:NAME} its output; {run:ARM} / {best:ARM} the run directory / its best/ weights of ARM with the same
seed (or ARM's only seed); {runs:ARM} / {bests:ARM} a YAML list over all of ARM's seeds. NAME and ARM may be
``STUDY/NAME`` for a study listed under ``uses:``. Other braces (YAML flow maps) are left alone."""


class StudyError(Exception):
    """A problem the user fixes (bad study file, failed step); printed as one line."""


# ------------------------------------------------------------------------------------------------ the study file

@dataclass(kw_only=True)
class PrepStep:
    name: str
    output: str
    """Path relative to the study's directory; the step is done when it exists (or ``complete`` inside it)."""
    command: list[str]
    complete: str = ""


@dataclass(kw_only=True)
class Arm:
    name: str
    config: str
    overrides: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    replaces_shared: list[str] = field(default_factory=list)
    """Shared keys this arm deliberately sets otherwise (a remedy arm); any other clash is an error."""
    note: str = ""


@dataclass(kw_only=True)
class EvalSpec:
    name: str
    tool: str
    args: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class TableSpec:
    kind: str
    """sts | glue | align | training (escape from chance, held-out MLM, STS avg of its evals) | report
    (pretrain-report overlay)."""
    title: str = ""
    evals: list[str] = field(default_factory=list)
    arms: list[str] = field(default_factory=list)
    """Rows (default: every arm)."""
    convention: str = "all"
    """STS: all (SimCSE: subsets concatenated), mean or wmean (SentEval)."""


@dataclass(kw_only=True)
class Study:
    name: str
    path: Path
    out: str = ""
    env: dict[str, str] = field(default_factory=dict)
    uses: dict[str, str] = field(default_factory=dict)
    prep: list[PrepStep] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    equal: list[str] = field(default_factory=list)
    """Resolved config keys that must be equal in every arm (checked before anything runs)."""
    arms: list[Arm] = field(default_factory=list)
    weights: str = "final"
    """Which weights the evaluations read: final (the run directory) or best (<run_dir>/best, STS-B dev)."""
    evals: list[EvalSpec] = field(default_factory=list)
    tables: list[TableSpec] = field(default_factory=list)

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise StudyError(f"{self.path}: no arm named {name!r} (arms: {', '.join(a.name for a in self.arms)})")


def _fields(cls, data, where: str) -> dict:
    """Checks a mapping's keys against a dataclass' fields (StudyError naming the unknown or missing ones)."""
    fields = [f for f in dataclasses.fields(cls) if f.name != "path"]
    _keys(data, {f.name for f in fields}, where)
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise StudyError(f"{where}: {', '.join(missing)} is required")
    return data


def _keys(data, valid: set[str] | None, where: str) -> dict:
    """``data`` if it is a mapping whose keys are among ``valid`` (None: any); else StudyError naming the unknown
    keys."""
    if not isinstance(data, dict):
        raise StudyError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(map(str, set(data) - valid)) if valid is not None else []
    if unknown:
        raise StudyError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    return data


def _seeds(value, where: str) -> list[int]:
    """A list of distinct integer seeds: a seed listed twice would be one run counted twice in every table."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise StudyError(f"{where}: expected a list of integers, e.g. seeds: [1, 2, 3], got {value!r}")
    twice = sorted({v for v in value if value.count(v) > 1})
    if twice:
        raise StudyError(f"{where}: seed {', '.join(map(str, twice))} is listed twice; each seed is one run, listed "
                         f"once")
    return value


def _strings(value, where: str) -> list[str]:
    """A list of strings; nested lists are spliced in (so a YAML anchor can hold a list of files)."""
    if not isinstance(value, list):
        raise StudyError(f"{where}: expected a list of strings, got {value!r}")
    flat = [x for v in value for x in (v if isinstance(v, list) else [v])]
    if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in flat):
        raise StudyError(f"{where}: expected a list of strings, got {value!r}")
    return [str(v) for v in flat]


TOP_KEYS = {"name", "out", "env", "uses", "prep", "shared", "arms", "evaluations", "tables"}
ENV_KEYS = re.compile(r"(OMP|MKL|OPENBLAS|NUMEXPR)_NUM_THREADS|TOKENIZERS_PARALLELISM|CUDA_VISIBLE_DEVICES|"
                      r"PRETRAIN_VERBOSE")
"""The variables a study file's ``env:`` may set: thread counts and the like. A study file comes from elsewhere as
configs do; one that set PYTHONPATH, LD_PRELOAD or PATH would run code of its choosing in every step."""


def load_study(path: str | os.PathLike) -> Study:
    """The study file -> Study; StudyError naming the dotted place of the first problem."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise StudyError(f"{path}: no such study file (see configs/studies/)")
    raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict) or set(raw) - TOP_KEYS:
        unknown = sorted(set(raw) - TOP_KEYS) if isinstance(raw, dict) else raw
        raise StudyError(f"{p}: unknown top-level key(s) {unknown}; valid: {', '.join(sorted(TOP_KEYS))}")
    shared = _keys(raw.get("shared") or {}, {"overrides", "equal"}, f"{p}: shared")
    evaluations = _keys(raw.get("evaluations") or {}, {"weights", "runs"}, f"{p}: evaluations")
    env, uses = (_keys(raw.get(k) or {}, None, f"{p}: {k}") for k in ("env", "uses"))
    study = Study(
        name=str(raw.get("name") or p.stem), path=p, out=str(raw.get("out") or ""),
        env={str(k): str(v) for k, v in env.items()},
        uses={str(k): str(v) for k, v in uses.items()},
        prep=[PrepStep(**{**_fields(PrepStep, d, f"{p}: prep[{i}]"),
                          "command": _strings(d.get("command"), f"{p}: prep[{i}].command")})
              for i, d in enumerate(raw.get("prep") or [])],
        shared=_strings(shared.get("overrides") or [], f"{p}: shared.overrides"),
        equal=_strings(shared.get("equal") or [], f"{p}: shared.equal"),
        arms=[Arm(**{**_fields(Arm, d, f"{p}: arms[{i}]"),
                     "overrides": _strings(d.get("overrides") or [], f"{p}: arms[{i}].overrides"),
                     "seeds": _seeds(d.get("seeds"), f"{p}: arms[{i}].seeds")})
              for i, d in enumerate(raw.get("arms") or [])],
        weights=str(evaluations.get("weights", "final")),
        evals=[EvalSpec(**{**_fields(EvalSpec, d, f"{p}: evaluations.runs[{i}]"),
                           "args": _strings(d.get("args") or [], f"{p}: evaluations.runs[{i}].args")})
               for i, d in enumerate(evaluations.get("runs") or [])],
        tables=[TableSpec(**{**_fields(TableSpec, d, f"{p}: tables[{i}]"),
                             **{k: _strings(d.get(k) or [], f"{p}: tables[{i}].{k}") for k in ("evals", "arms")}})
                for i, d in enumerate(raw.get("tables") or [])],
    )
    _check(study)
    return study


def _check(s: Study) -> None:
    """StudyError naming the first thing wrong with the study file: names, prep steps and env, arms, evaluations,
    tables."""
    where = str(s.path)
    names = [a.name for a in s.arms]
    if not names:
        raise StudyError(f"{where}: arms is empty; a study needs at least one arm")
    for kind, items in (("arm", names), ("prep step", [x.name for x in s.prep]),
                        ("evaluation", [e.name for e in s.evals])):
        dup = sorted({n for n in items if items.count(n) > 1})
        if dup:
            raise StudyError(f"{where}: {kind} name(s) used twice: {', '.join(dup)}")
        bad = [n for n in items if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", n)]
        if bad:
            raise StudyError(f"{where}: {kind} name(s) {bad} must be letters, digits, '_', '-', '.'")
    _check_prep(s, where)
    _check_arms(s, where)
    if s.weights not in ("final", "best"):
        raise StudyError(f"{where}: evaluations.weights must be final or best, got {s.weights!r}")
    for e in s.evals:
        if e.tool not in EVAL_RESULTS:
            raise StudyError(f"{where}: evaluation {e.name}: tool must be one of {', '.join(EVAL_RESULTS)}")
        taken = sorted({a.split("=")[0] for a in e.args} & {"--model", "--out", "--name"})
        if taken:
            raise StudyError(f"{where}: evaluation {e.name}: {', '.join(taken)} are set by the driver")
    _check_tables(s, where)


def _check_tables(s: Study, where: str) -> None:
    for t in s.tables:
        if t.kind not in ("sts", "glue", "align", "training", "report"):
            raise StudyError(f"{where}: table kind {t.kind!r} is not one of sts, glue, align, training, report")
        for e in t.evals:
            if e not in [x.name for x in s.evals]:
                raise StudyError(f"{where}: table {t.title or t.kind} names evaluation {e!r}, which "
                                 f"evaluations.runs lacks")
        for a in t.arms:
            s.arm(a)
        if t.kind not in ("report", "training") and not t.evals:
            raise StudyError(f"{where}: table {t.title or t.kind} needs evals: [NAME, ...]")
        if t.convention not in ("all", "mean", "wmean"):
            raise StudyError(f"{where}: table {t.title or t.kind}: convention must be all, mean or wmean")




def _check_prep(s: Study, where: str) -> None:
    """Prep steps write inside the study's directory and run pretrain's own CLIs; env sets thread counts only."""
    for x in s.prep:  # a stale output is removed (rmtree) before it is redone: it must lie inside the study's out
        for key, value in (("output", x.output), ("complete", x.complete)):
            rel = Path(value)
            if (key == "output" or value) and (rel.is_absolute() or ".." in rel.parts or rel.parts in ((), (".",))):
                raise StudyError(f"{where}: prep step {x.name}: {key} {value!r} must be a path inside the study's "
                                 f"directory (relative, without '..'): the driver removes a stale output before "
                                 f"redoing it, so it refuses one that could name anything else")
    for x in s.prep:  # a study file, like a config, is read, not run: its commands are pretrain's own CLIs
        if not x.command or x.command[0] not in TOOLS:
            raise StudyError(f"{where}: prep step {x.name}: command {x.command[:1]} is not one of pretrain's CLIs "
                             f"({', '.join(TOOLS)}); a study runs only those. Run any other program yourself "
                             f"before the study and give its output as a path")
    bad_env = sorted(k for k in s.env if not ENV_KEYS.fullmatch(k))
    if bad_env:
        raise StudyError(f"{where}: env: {', '.join(bad_env)} may not be set by a study file (it sets thread counts "
                         f"and the like: {ENV_KEYS.pattern.replace('|', ', ')}); set others in your own shell")


def _check_arms(s: Study, where: str) -> None:
    for a in s.arms:
        if not a.seeds:
            raise StudyError(f"{where}: arm {a.name}: seeds is empty; list one or more, e.g. seeds: [1234]")
        for o in a.overrides:
            if _key(o) in ("seed", "run_dir"):
                raise StudyError(f"{where}: arm {a.name}: {_key(o)} is set by the driver (seeds:, the study's out)")
        shared_keys = {_key(o) for o in s.shared}
        for k in a.replaces_shared:
            if not any(_clashes(k, sk) for sk in shared_keys):
                raise StudyError(f"{where}: arm {a.name}: replaces_shared lists {k}, which shared.overrides does "
                                 f"not set")
        for o in a.overrides:
            clash = [k for k in shared_keys if _clashes(_key(o), k)]
            if clash and _key(o) not in a.replaces_shared:
                raise StudyError(
                    f"{where}: arm {a.name} sets {_key(o)}, a shared setting ({', '.join(clash)}); shared settings are "
                    f"the same for every arm. List it under the arm's replaces_shared if this arm is meant to differ")


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def _clashes(a: str, b: str) -> bool:
    """Same key, or one inside the other (objective.nt_xent vs objective.nt_xent.temperature). The size preset
    ``model=NAME`` only sets sizes, so it does not clash with other model.* keys."""
    if "model" in (a, b):
        return a == b
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


# ------------------------------------------------------------------------------------------------ the plan

@dataclass
class Step:
    id: str
    kind: str
    """prep | train | eval | report"""
    argv: list[str]
    output: Path
    deps: list[str] = field(default_factory=list)
    complete: str = ""
    tool: str = ""


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


class Planner:
    """Turns a Study into Steps: placeholders resolved, dependencies found, arms in dependency order."""

    def __init__(self, study: Study, out: Path, data_dir: Path, used: dict[str, tuple[Study, Path]]):
        self.study, self.out, self.data_dir, self.used = study, out, data_dir, used
        self.resolved: dict[str, dict] = {}
        """Each run's resolved config (run_name -> dict), filled by ``configs``."""

    # -- where things are
    def run_dir(self, arm: str, seed: int, study: str = "") -> Path:
        out = self.used[study][1] if study else self.out
        return out / "runs" / run_name(arm, seed)

    def weights(self, arm: str, seed: int) -> Path:
        run = self.run_dir(arm, seed)
        return run / "best" if self.study.weights == "best" else run

    def _study_of(self, ref: str) -> tuple[str, str, Study]:
        if "/" not in ref:
            return "", ref, self.study
        name, inner = ref.split("/", 1)
        if name not in self.used:
            raise StudyError(f"{self.study.path}: {{...:{ref}}} names study {name!r}, which uses: does not list")
        return name, inner, self.used[name][0]

    def _seed_of(self, arm: Arm, seed: int | None, ref: str) -> int:
        if seed is not None and seed in arm.seeds:
            return seed
        if len(arm.seeds) == 1:
            return arm.seeds[0]
        raise StudyError(f"{self.study.path}: {{run:{ref}}} is ambiguous: arm {arm.name} has seeds {arm.seeds} and "
                         f"this run's seed {seed} is not one of them; use {{runs:{ref}}} for all of them")

    def resolve(self, text: str, *, seed: int | None = None, output: Path | None = None,
                deps: set[str] | None = None) -> str:
        """``text`` with its placeholders filled in; the steps they point at are added to ``deps``."""
        deps = set() if deps is None else deps

        def fill(m: re.Match) -> str:
            simple, kind, ref = m.group(1), m.group(2), m.group(3)
            if simple == "data":
                return str(self.data_dir)
            if simple == "out":
                return str(self.out)
            if simple == "seed":
                if seed is None:
                    raise StudyError(f"{self.study.path}: {{seed}} outside an arm in {text!r}")
                return str(seed)
            if simple == "output":
                if output is None:
                    raise StudyError(f"{self.study.path}: {{output}} outside a prep command in {text!r}")
                return str(output)
            study_name, name, study = self._study_of(ref)
            if kind == "prep":
                step = next((x for x in study.prep if x.name == name), None)
                if step is None:
                    raise StudyError(f"{self.study.path}: {{prep:{ref}}}: study {study.name} has no prep step {name!r}")
                base = self.used[study_name][1] if study_name else self.out
                deps.add(f"{study_name + ':' if study_name else ''}prep/{name}")
                return str(base / step.output)
            arm = study.arm(name)
            seeds = arm.seeds if kind in ("runs", "bests") else [self._seed_of(arm, seed, ref)]
            dirs = [self.run_dir(name, s, study_name) for s in seeds]
            if kind in ("best", "bests"):
                dirs = [d / "best" for d in dirs]
            deps.update(f"{study_name + ':' if study_name else ''}train/{run_name(name, s)}" for s in seeds)
            return str(dirs[0]) if kind in ("run", "best") else "[" + ", ".join(map(str, dirs)) + "]"

        return PLACEHOLDER.sub(fill, text)

    # -- the steps
    def train_argv(self, arm: Arm, seed: int, deps: set[str] | None = None) -> tuple[str, list[str]]:
        """(config path, overrides) of one run: shared settings, then the arm's, then seed and run_dir."""
        overrides = [self.resolve(o, seed=seed, deps=deps) for o in self.study.shared + arm.overrides]
        overrides += [f"seed={seed}", f"run_dir={self.run_dir(arm.name, seed)}"]
        return arm.config, overrides

    def arm_order(self) -> list[Arm]:
        """Arms with every arm after the arms its runs start from (a cycle is an error)."""
        needs = {}
        for a in self.study.arms:
            deps: set[str] = set()
            for s in a.seeds:
                self.train_argv(a, s, deps)
            needs[a.name] = {d.split("/", 1)[1].rsplit("-seed", 1)[0] for d in deps if d.startswith("train/")}
        order, done = [], set()
        while len(order) < len(self.study.arms):
            ready = [a for a in self.study.arms if a.name not in done and needs[a.name] <= done]
            if not ready:
                left = [a.name for a in self.study.arms if a.name not in done]
                raise StudyError(f"{self.study.path}: arms {left} depend on each other in a cycle")
            order.append(ready[0])
            done.add(ready[0].name)
        return order

    def steps(self) -> list[Step]:
        py = [sys.executable, "-m"]
        steps = []
        for p in self.study.prep:
            deps: set[str] = set()
            output = self.out / p.output
            argv = [self.resolve(a, output=output, deps=deps) for a in p.command]
            if argv and argv[0] in TOOLS:
                argv = py + [TOOLS[argv[0]]] + argv[1:]
            steps.append(Step(f"prep/{p.name}", "prep", argv, output, sorted(deps), complete=p.complete))
        for arm in self.arm_order():
            for seed in arm.seeds:
                deps = set()
                config, overrides = self.train_argv(arm, seed, deps)
                name = run_name(arm.name, seed)
                steps.append(Step(f"train/{name}", "train", py + [TOOLS["pretrain-train"], config, *overrides],
                                  self.run_dir(arm.name, seed), sorted(deps)))
                for e in self.study.evals:
                    out = self.out / "evals" / name / e.name
                    args = [self.resolve(a, seed=seed) for a in e.args]
                    argv = py + [TOOLS[e.tool], "--model", str(self.weights(arm.name, seed)), "--out", str(out),
                                 "--name", name, *args]
                    steps.append(Step(f"eval/{name}/{e.name}", "eval", argv, out, [f"train/{name}"], tool=e.tool))
        for t in self.study.tables:
            if t.kind == "report":
                arms = [self.study.arm(a) for a in t.arms] if t.arms else self.study.arms
                runs = [(a.name, s) for a in arms for s in a.seeds]
                out = self.out / "report"
                argv = py + [TOOLS["pretrain-report"], *(str(self.run_dir(a, s)) for a, s in runs), "--out", str(out)]
                steps.append(Step("report", "report", argv, out, [f"train/{run_name(a, s)}" for a, s in runs]))
        return steps

    def configs(self) -> dict[str, dict]:
        """Each arm's resolved config (first seed) as a dict; the config errors of every run, before any runs."""
        out = {}
        for arm in self.study.arms:
            for seed in arm.seeds:
                config, overrides = self.train_argv(arm, seed)
                try:
                    cfg = load_run_config(config, overrides)
                except (ValueError, FileNotFoundError) as e:
                    raise StudyError(f"arm {arm.name} (seed {seed}): {e}") from None
                self.resolved[run_name(arm.name, seed)] = to_dict(cfg)
                out.setdefault(arm.name, self.resolved[run_name(arm.name, seed)])
        for key in self.study.equal:
            if all(_lookup(c, key) is _MISSING for c in out.values()):
                raise StudyError(f"{self.study.path}: shared.equal: {key} is not a config key")
            values = {a: _lookup(c, key) for a, c in out.items()}
            values = {a: "(absent)" if v is _MISSING else v for a, v in values.items()}  # under a null block
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
                raise StudyError(f"{self.study.path}: shared.equal: {key} differs between arms: "
                                 + ", ".join(f"{a}={v}" for a, v in values.items()))
        return out


_MISSING = object()


def _lookup(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part, _MISSING) if isinstance(d, dict) else _MISSING
    return d
