"""``pretrain-study``: run a study (prepared data, arms x seeds of runs, evaluations, tables) from one YAML file.

The same evaluations run for every run; the tables follow the papers' layouts, with an overlay report of the runs.

    pretrain-study configs/studies/clear_small.yaml [--out DIR] [--only ARM ...] [--dry-run] [--use STUDY=DIR]

Every step is a subprocess of the real CLIs (``pretrain-tokenizer``, ``pretrain-preprocess``, ``python -m
pretrain.train``, ``pretrain-eval``, ``pretrain-finetune-glue``, ``pretrain-report``) logging to
``OUT/logs/<step>.log``. A step whose result exists is skipped: a run whose newest checkpoint has reached its
``train.max_steps``, an evaluation whose result file exists, a preparation step whose output exists (the tools
write theirs atomically). An interrupted run is relaunched with the same ``run_dir`` and resumes from its newest
checkpoint. A run done (or begun) with another command, or whose recipe's objective/optim settings differ from
its config.yaml (a config file edited since), is refused, not reused; the tables read only the runs and
evaluations of the study as it is now (``current_steps``). ``OUT/status.json`` records every step (done, skipped,
failed), its wall and CPU seconds (``getrusage(RUSAGE_CHILDREN)``) and the study's total, so the compute a study
used can be reported. The study file and the plan: ``plan.py``; the tables: ``tables.py``.

A run that diverges (``pretrain-train`` exit 3: TrainingDiverged) is a result, not a failure: it is recorded as
``diverged`` (with the step the trainer names), the steps that need it (its evaluations, runs starting from it) are
skipped as ``blocked``, the study goes on and ends 0, its summary line and ``status.json`` (``invocations[-1]
.diverged``, ``totals.runs_diverged``) naming the runs; the tables count the seed as diverged. A later invocation
keeps it (no relaunch that would diverge again) unless ``--retry-diverged``, its run directory was moved away, or
its command changed. Any other failure (another exit code, a result missing after exit 0) stops the study.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.checkpoint.files import atomic_write_text
from pretrain.eval import RESULT_FILES, default_data_dir
from pretrain.study.plan import (
    Planner,
    Step,
    Study,
    StudyError,
    load_study,
)
from pretrain.study.outputs import (
    DIVERGED_EXIT,
    divergence,
    diverged_stamp,
    last_line,
    final_step,
    is_done,
    recipe_changes,
    recorded_step,
    remove_output,
    stamp,
)
from pretrain.study.tables import write_results

# ------------------------------------------------------------------------------------------------ running

def portable(argv: list[str], out: Path) -> list[str]:
    """argv as recorded: the study directory as {out}, the interpreter as python (moving either is no change)."""
    return [("python" if a == sys.executable else a.replace(str(out), "{out}")) for a in argv]


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class Status:
    """OUT/status.json: one record per step and per invocation, rewritten atomically after every step."""

    def __init__(self, path: Path, study: Study, out: Path):
        self.path, self.out = path, out
        self.data = json.loads(path.read_text()) if path.is_file() else {}
        self.data.update(study=study.name, file=str(study.path), out=str(out))
        self.data.setdefault("steps", {})
        self.data.setdefault("invocations", [])

    def portable(self, argv: list[str]) -> list[str]:
        return portable(argv, self.out)

    def save(self) -> None:
        steps = self.data["steps"].values()
        inv = self.data["invocations"]
        self.data["totals"] = {
            "steps_done": sum(1 for r in steps if r.get("state") == "done"),
            "runs_diverged": sum(1 for r in steps if r.get("state") == "diverged"),
            "steps_wall_s": round(sum(r.get("wall_s", 0) for r in steps), 1),
            "steps_cpu_s": round(sum(r.get("cpu_s", 0) for r in steps), 1),
            "invocations_wall_s": round(sum(i.get("wall_s", 0) for i in inv), 1),
            "cpu_s": round(sum(i.get("cpu_s", 0) for i in inv), 1),
        }
        self.data["totals"]["cpu_h"] = round(self.data["totals"]["cpu_s"] / 3600, 3)
        self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        atomic_write_text(self.path, json.dumps(self.data, indent=1))


class Runner:
    def __init__(self, study: Study, out: Path, env: dict, status: Status, say=print, resolved: dict | None = None,
                 retry_diverged: bool = False):
        self.study, self.out, self.env, self.status, self.say = study, out, env, status, say
        self.resolved = resolved or {}
        """Each run's resolved config (Planner.resolved): a run trained with other recipe settings is a conflict."""
        self.retry_diverged = retry_diverged
        """Relaunch the runs recorded as diverged (else they are kept as they are)."""
        self.stamps: dict[str, str] = {}
        self.diverged: dict[str, int | None] = {}
        """Runs that diverged (this invocation or kept from an earlier one) -> the step, where known."""
        self.held: dict[str, list[str]] = {}
        """Steps skipped because a run they need diverged -> those diverged runs."""
        self.digests = status.data.setdefault("weights_digests", {})
        self.child: subprocess.Popen | None = None
        self.stopping = False

    def state(self, step: Step) -> tuple[str, str]:
        """(todo | done | stale | blocked | held | diverged, why). held: a run it needs diverged (a report draws a
        diverged run's curves: only a run skipped holds it); diverged: a run recorded as diverged, kept."""
        roots = self.held_by(step)
        if roots:
            return "held", f"{', '.join(roots)} diverged"
        missing = [d for d in step.deps if d not in self.stamps]
        if missing:
            return "blocked", f"waits for {', '.join(missing)}"
        if step.kind == "train":
            self._check_recipe(step)
        if not is_done(step):
            rec = self.status.data["steps"].get(step.id) or {}
            if (step.kind == "train" and rec.get("state") == "diverged" and not self.retry_diverged
                    and rec.get("argv") == self.status.portable(step.argv) and step.output.is_dir()):
                at = rec.get("diverged_at")
                return "diverged", f"{f'at step {at}, ' if at is not None else ''}on {rec.get('finished')}"
            return "todo", ""
        rec = self.status.data["steps"].get(step.id)
        if rec is None or "argv" not in rec:
            return "done", "result found (no record)"
        changed = [d for d in step.deps if rec.get("deps", {}).get(d) not in (None, self.stamps[d])]
        now = self.status.portable(step.argv)
        if rec.get("argv") != now:
            if step.kind in ("train", "prep"):
                was = rec.get("argv") or []
                diff = next((f"{a!r} is now {b!r}" for a, b in zip(was, now) if a != b), "arguments added or removed")
                raise StudyError(
                    f"{step.id} was done with another command ({diff}); its output {self._rel(step.output)} stays "
                    f"as it is: restore the study's settings, or move that output away to redo it")
            return "stale", "its command changed"
        if changed and step.kind in ("eval", "report"):
            return "stale", f"{', '.join(changed)} changed since"
        if changed:
            self.say(f"note: {step.id} is kept although {', '.join(changed)} changed since it ran; move "
                     f"{self._rel(step.output)} away to redo it")
        return "done", ""

    def held_by(self, step: Step) -> list[str]:
        """The diverged runs that keep ``step`` from running: its own runs' divergence, or its dependencies'."""
        roots = {r for d in step.deps for r in self.held.get(d, [])}
        roots |= {d for d in step.deps if d in self.diverged and step.kind != "report"}
        return sorted(roots)

    def _check_recipe(self, step: Step) -> None:
        """StudyError when the run (finished or to be resumed) was trained with other objective/optimizer settings
        than the study resolves now."""
        import yaml

        planned = self.resolved.get(step.id.split("/", 1)[1])
        config = step.output / "config.yaml"
        if planned is None or not config.is_file():
            return
        changes = recipe_changes(yaml.safe_load(config.read_text(encoding="utf-8")) or {}, planned)
        if changes:
            raise StudyError(
                f"{step.id} was trained with {'; '.join(changes[:3])}{' ...' if len(changes) > 3 else ''} (a config "
                f"file it reads changed since it ran; its command did not); its output {self._rel(step.output)} "
                f"stays as it is: restore those settings (e.g. as the arm's overrides), or move that output away to "
                f"redo it")

    def _rel(self, p) -> str:
        rel = os.path.relpath(p)
        return str(p) if rel.startswith("..") else rel

    def log_path(self, step: Step) -> Path:
        return self.out / "logs" / (step.id.replace("/", os.sep) + ".log")

    def execute(self, steps: list[Step], invocation: dict) -> None:
        skips = {"done": self._skip_done, "held": self._hold, "diverged": self._keep_diverged}
        for i, step in enumerate(steps, 1):
            counter = f"[{i}/{len(steps)}]"
            state, why = self.state(step)
            rec = self.status.data["steps"].setdefault(step.id, {"kind": step.kind})
            if state == "blocked":
                raise StudyError(f"{step.id} cannot start: it {why}")
            if state in skips:
                skips[state](step, rec, f"{counter} {step.id}: ", why, invocation)
                self.status.save()
                continue
            if state == "stale":
                self.say(f"{counter} {step.id}: out of date ({why}); redoing")
                remove_output(step.output, self.out)
            self._run(step, rec, counter)
            invocation["ran"].append(step.id)
            if step.id in self.diverged:
                invocation["diverged"].append(step.id)
            self.status.save()

    def _skip_done(self, step: Step, rec: dict, head: str, why: str, invocation: dict) -> None:
        self.stamps[step.id] = stamp(step, self.digests)
        rec.update(state="done", last="skipped", log=self._rel(self.log_path(step)),
                   argv=self.status.portable(step.argv), stamp=self.stamps[step.id])
        rec.setdefault("deps", {d: self.stamps[d] for d in step.deps})
        invocation["skipped"].append(step.id)
        self.say(f"{head}done, skipped")

    def _hold(self, step: Step, rec: dict, head: str, why: str, invocation: dict) -> None:
        """A step that needs a diverged run: skipped, recorded as blocked by it (not an error)."""
        self.held[step.id] = self.held_by(step)
        rec.update(state="blocked", last="blocked", blocked_by=self.held[step.id])
        invocation["blocked"].append(step.id)
        self.say(f"{head}skipped ({why})")

    def _keep_diverged(self, step: Step, rec: dict, head: str, why: str, invocation: dict) -> None:
        """A run recorded as diverged by an earlier invocation: kept (relaunching it would diverge again), said
        once, with how to train it again."""
        self.diverged[step.id] = rec.get("diverged_at")
        self.stamps[step.id] = rec.setdefault("stamp", diverged_stamp(rec))
        rec["last"] = "kept"
        invocation["diverged"].append(step.id)
        self.say(f"{head}kept as diverged ({why}); the steps that need it are skipped. To train it again: rerun "
                 f"with --retry-diverged (it resumes from its last good checkpoint), or move {self._rel(step.output)} "
                 f"away (it starts over)")

    def _record_divergence(self, step: Step, rec: dict, log: Path) -> None:
        """Exit 3 of a run: recorded as diverged (with the step the trainer names); the study goes on."""
        at, message = divergence(log, step.output)
        rec.update(state="diverged", last="diverged", diverged_at=at, message=message)
        rec["stamp"] = diverged_stamp(rec)
        self.diverged[step.id], self.stamps[step.id] = at, rec["stamp"]
        self.say(f"    diverged{f' at step {at}' if at is not None else ''} (exit {DIVERGED_EXIT}): {message}\n"
                 f"    kept as a result: the steps that need it are skipped, the study goes on")

    def _run(self, step: Step, rec: dict, counter: str) -> None:
        weights = Path(step.argv[step.argv.index("--model") + 1]) if step.kind == "eval" else None
        if weights is not None and self.study.weights == "best" and not weights.is_dir():
            raise StudyError(f"{step.id}: evaluations.weights is best but {step.deps[0]} wrote no best/ weights: set "
                             f"eval.stsb_every in shared.overrides (STS-B dev keep-best), or use weights: final")
        if step.tool == "pretrain-eval":  # not done (no eval.json): a result file left beside it is the study's own,
            for name in RESULT_FILES:  # which pretrain-eval refuses to replace without --overwrite; an unfinished
                (step.output / name).unlink(missing_ok=True)  # transfer_partial.json stays: the rerun resumes it
        log = self.log_path(step)
        log.parent.mkdir(parents=True, exist_ok=True)
        resumed = step.kind == "train" and final_step(step.output)[0] >= 0
        self.say(f"{counter} {step.id}: {'resuming' if resumed else 'running'} (log {self._rel(log)})")
        for key in ("diverged_at", "message", "blocked_by"):  # of an earlier divergence or hold
            rec.pop(key, None)
        t0, cpu0 = time.perf_counter(), _cpu(resource.RUSAGE_CHILDREN)
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {shlex.join(step.argv)}\n")
            f.flush()
            self.child = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env)
            rc = self.child.wait()
            self.child = None
        wall, cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_CHILDREN) - cpu0
        rec.update(wall_s=round(rec.get("wall_s", 0) + wall, 1) if resumed else round(wall, 1),
                   cpu_s=round(rec.get("cpu_s", 0) + cpu, 1) if resumed else round(cpu, 1),
                   log=self._rel(log), argv=self.status.portable(step.argv), rc=rc,
                   finished=time.strftime("%Y-%m-%dT%H:%M:%S"), deps={d: self.stamps[d] for d in step.deps})
        if self.stopping:
            rec.update(state="interrupted", last="interrupted")
            self.status.save()
            raise StudyError(f"interrupted during {step.id} (log {self._rel(log)}); rerun the same command to continue")
        if rc == DIVERGED_EXIT and step.kind == "train":
            self._record_divergence(step, rec, log)
            return
        if rc != 0 or not is_done(step):
            rec.update(state="failed", last="failed")
            self.status.save()
            why = f"exit {rc}" if rc else "it exited 0 but its result is missing"
            raise StudyError(f"{step.id} failed ({why}): {last_line(log)} — log: {self._rel(log)}")
        self.stamps[step.id] = stamp(step, self.digests)
        rec.update(state="done", last="ran", stamp=self.stamps[step.id])
        self.say(f"    done in {wall:.1f} s wall, {cpu:.1f} CPU-s")

    def interrupt(self, signum, frame) -> None:
        """SIGTERM/SIGINT: the running step gets SIGTERM (the trainer checkpoints and exits), then the driver stops."""
        self.stopping = True
        if self.child is not None and self.child.poll() is None and signum != signal.SIGINT:
            self.child.send_signal(signal.SIGTERM)  # SIGINT from a terminal reaches the child by itself
        if self.child is None:
            raise KeyboardInterrupt


# ------------------------------------------------------------------------------------------------ the CLI

def _used_studies(study: Study, given: dict[str, str]) -> dict[str, tuple[Study, Path]]:
    used = {}
    for name, path in study.uses.items():
        other = load_study(path)
        out = Path(given.get(name) or other.out or f"runs/studies/{other.name}").resolve()
        used[name] = (other, out)
    unknown = set(given) - set(study.uses)
    if unknown:
        raise StudyError(f"--use {', '.join(sorted(unknown))}: not listed under uses: in {study.path}")
    return used


def _given_dirs(uses: list[str]) -> dict[str, str]:
    """--use STUDY=DIR ... as {STUDY: DIR}; one without its =DIR is an error (dropped, the study would read the
    default directory's runs)."""
    given = {}
    for u in uses:
        name, _, path = u.partition("=")
        if not name or not path:
            raise StudyError(f"--use {u!r}: expected STUDY=DIR, e.g. --use clear_small=runs/studies/clear_small")
        given[name] = path
    return given


def current_steps(steps: list[Step], runner: Runner) -> set[str]:
    """Ids of the runs and evaluations whose results belong to the study as it is now: a run last launched with its
    present command; an evaluation done with its present command on the present weights of its finished run. The
    tables read only these: after an arm is edited, ``--only`` of another arm leaves its old results on disk."""
    records, current = runner.status.data["steps"], set()
    for step in steps:
        rec = records.get(step.id) or {}
        if step.kind not in ("train", "eval") or rec.get("argv") != runner.status.portable(step.argv):
            continue
        if step.kind == "train":
            current.add(step.id)
            if step.id not in runner.stamps and is_done(step):
                runner.stamps[step.id] = stamp(step, runner.digests)
        elif rec.get("state") == "done" and rec.get("deps", {}).get(step.deps[0], "") == runner.stamps.get(
                step.deps[0]):  # the weights it read are the run's present ones
            current.add(step.id)
    return current


def _select(steps: list[Step], only: list[str], study: Study) -> list[Step]:
    """With --only: those arms' steps and the steps they need (transitively), plus the preparation."""
    if not only:
        return steps
    for a in only:
        study.arm(a)
    by_id = {s.id: s for s in steps}
    keep = {s.id for s in steps if s.kind == "prep"}
    todo = [s.id for s in steps if s.kind in ("train", "eval") and s.id.split("/")[1].rsplit("-seed", 1)[0] in only]
    while todo:
        sid = todo.pop()
        if sid in keep or sid not in by_id:
            continue
        keep.add(sid)
        todo += by_id[sid].deps
        if by_id[sid].kind == "train":  # a needed run comes with its evaluations
            todo += [s.id for s in steps if s.kind == "eval" and s.deps == [sid]]
    return [s for s in steps if s.id in keep]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pretrain-study", description=__doc__.splitlines()[0])
    p.add_argument("study", help="study file (configs/studies/*.yaml)")
    p.add_argument("--out", default=None, help="study directory (default: the file's out:, else runs/studies/NAME)")
    p.add_argument("--only", nargs="+", default=[], metavar="ARM",
                   help="run only these arms (and the runs they start from); tables cover what exists")
    p.add_argument("--dry-run", action="store_true",
                   help="check the study and every run's config, print the plan, run nothing")
    p.add_argument("--use", action="append", default=[], metavar="STUDY=DIR",
                   help="directory of a study named under uses: (default: that study's own out:)")
    p.add_argument("--retry-diverged", action="store_true",
                   help="relaunch the runs recorded as diverged (exit 3); without it they are kept as results")
    args = p.parse_args(argv)
    try:
        return run_study(args)
    except StudyError as e:
        print(f"pretrain-study: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pretrain-study: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130


def run_study(args) -> int:
    study = load_study(args.study)
    out = Path(args.out or study.out or f"runs/studies/{study.name}").resolve()
    given = _given_dirs(args.use)
    data_dir = Path(default_data_dir()).resolve()
    planner = Planner(study, out, data_dir, _used_studies(study, given))
    configs = planner.configs()  # every run's config is valid before the first one starts
    steps = _select(planner.steps(), args.only, study)
    if args.dry_run:
        return _print_plan(planner, steps, out, args.retry_diverged)
    out.mkdir(parents=True, exist_ok=True)
    status = Status(out / "status.json", study, out)
    env = {**os.environ, **study.env, "PRETRAIN_DATA_DIR": str(data_dir)}
    runner = Runner(study, out, env, status, resolved=planner.resolved, retry_diverged=args.retry_diverged)
    _require_used(planner, steps, runner)
    invocation = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "only": args.only, "ran": [], "skipped": [],
                  "diverged": [], "blocked": []}
    status.data["invocations"].append(invocation)
    t0, cpu0 = time.perf_counter(), _cpu(resource.RUSAGE_CHILDREN) + _cpu(resource.RUSAGE_SELF)
    old = {s: signal.signal(s, runner.interrupt) for s in (signal.SIGTERM, signal.SIGINT)}

    def close(result: str) -> None:
        invocation.update(wall_s=round(time.perf_counter() - t0, 2), result=result,
                          cpu_s=round(_cpu(resource.RUSAGE_CHILDREN) + _cpu(resource.RUSAGE_SELF) - cpu0, 2))
        status.save()

    try:
        runner.execute(steps, invocation)
        close("writing tables")  # the tables' compute line includes this invocation

        current = current_steps(planner.steps(), runner)
        results = write_results(study, planner, configs, status.data, current)
    except StudyError as e:
        close(f"failed: {e}")
        raise
    except KeyboardInterrupt:
        close("interrupted")
        raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    diverged = _diverged_note(runner, invocation)
    close("ok" + diverged)
    t = status.data["totals"]
    print(f"study {study.name}: {len(invocation['ran'])} step(s) ran, {len(invocation['skipped'])} skipped"
          f"{diverged}, {invocation['wall_s']:.1f} s; total so far {t['cpu_h']:.3f} CPU-h. Tables: "
          f"{runner._rel(results)}")
    return 0


def _diverged_note(runner: Runner, invocation: dict) -> str:
    """', N run(s) diverged (...)' for the summary line: the exit code stays 0 (a divergence is a result), so this
    line and status.json's invocations[-1].diverged / totals.runs_diverged are how a script tells."""
    runs = invocation["diverged"]
    if not runs:
        return ""
    at = [f"{r}{f' at step {runner.diverged[r]}' if runner.diverged.get(r) is not None else ''}" for r in runs]
    return (f", {len(runs)} run(s) diverged ({', '.join(at)}; {len(invocation['blocked'])} step(s) needing them "
            f"skipped; --retry-diverged relaunches them)")


def _require_used(planner: Planner, steps: list[Step], runner: Runner) -> None:
    """Steps of other studies (``uses:``) are not run here: each must be done already."""
    needed = sorted({d for s in steps for d in s.deps if ":" in d})
    for dep in needed:
        name, sid = dep.split(":", 1)
        other, out = planner.used[name]
        kind, rest = sid.split("/", 1)
        if kind == "prep":
            p = next(x for x in other.prep if x.name == rest)
            step = Step(sid, "prep", [], out / p.output, complete=p.complete)
        else:
            step = Step(sid, "train", [], out / "runs" / rest)
        if not is_done(step):
            arm = rest.rsplit("-seed", 1)[0]
            hint = f" --only {arm}" if kind == "train" else ""
            rec = recorded_step(out / "status.json", sid)
            if rec.get("state") == "diverged":
                at = rec.get("diverged_at")
                raise StudyError(f"this study starts from {name}'s {sid}, which diverged"
                                 f"{f' at step {at}' if at is not None else ''} ({runner._rel(step.output)}): "
                                 f"nothing here can start from it; retry it with `pretrain-study {other.path}{hint} "
                                 f"--retry-diverged`, or pass --use {name}=DIR for another run of it")
            raise StudyError(f"this study starts from {name}'s {sid}, which is not finished "
                             f"({runner._rel(step.output)}): run `pretrain-study {other.path}{hint}` first "
                             f"(or pass --use {name}=DIR)")
        runner.stamps[dep] = stamp(step, runner.digests)


def _print_plan(planner: Planner, steps: list[Step], out: Path, retry_diverged: bool = False) -> int:
    runner = Runner(planner.study, out, {}, Status(out / "status.json", planner.study, out), say=lambda _: None,
                    resolved=planner.resolved, retry_diverged=retry_diverged)
    for dep in sorted({d for s in steps for d in s.deps if ":" in d}):
        runner.stamps[dep] = "external"
    print(f"study {planner.study.name}: {len(steps)} steps, directory {runner._rel(out)}")
    for step in steps:
        try:
            state, why = runner.state(step)
        except StudyError as e:
            state, why = "conflict", str(e)
        if state in ("done", "stale") or (state == "todo" and step.kind == "train" and final_step(step.output)[0] >= 0):
            runner.stamps[step.id] = stamp(step, runner.digests) if state != "todo" else "partial"
        elif state in ("todo", "blocked"):
            runner.stamps[step.id] = "planned"
        elif state == "diverged":
            runner.diverged[step.id], runner.stamps[step.id] = None, "diverged"
        elif state == "held":
            runner.held[step.id] = runner.held_by(step)
        print(f"  [{state}] {step.id}" + (f" ({why})" if why else ""))
        print(f"      $ {shlex.join(portable(step.argv, out))}")
    print("dry run: nothing was run; drop --dry-run to run the steps marked todo/stale (diverged: kept as "
          "results, --retry-diverged relaunches them; held: skipped, a run they need diverged).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
