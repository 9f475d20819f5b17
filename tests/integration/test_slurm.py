"""slurm/pretrain.sbatch on a real one-node Slurm cluster (tests/slurm/cluster.py), on CPU.

Five jobs run side by side: an uninterrupted 2-worker `pretrain.train` run; the same run
preempted with USR1 (checkpoint -> self-requeue -> resume), whose per-step losses must equal the
uninterrupted ones; `scontrol requeue` (SIGTERM) and a USR1 during worker start-up on the stand-in
trainer (tests/slurm/payload.py, checked against a float64 reference); and `srun -n 2` without
torchrun (the Slurm branch of detect_env).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.distributed.env import default_master_port

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "pretrain.sbatch"
PAYLOAD = REPO / "tests" / "slurm" / "payload.py"
MAX_STEPS = 24
STOP_AFTER = 5  # signal once this many steps are logged
PAYLOAD_STEPS = 16
EARLY_STEPS = 40  # long enough that a resent USR1 (every 2 s) lands before the stand-in finishes, however loaded
SLOW_START = 3  # the "early" stand-in keeps USR1 ignored this long after it started (> the forward's latency)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


def _load(name: str):
    """tests/slurm/<name>.py as a module (tests/ is not a package), loaded once per process."""
    if f"slurm_{name}" in sys.modules:
        return sys.modules[f"slurm_{name}"]
    spec = importlib.util.spec_from_file_location(f"slurm_{name}", REPO / "tests" / "slurm" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cluster():
    mod = _load("cluster")
    lc = mod.LocalCluster()
    try:
        started = lc.start(timeout_s=60)
    except mod.SlurmUnavailable as e:
        pytest.skip(str(e))
    yield lc
    if started:  # a cluster the CI started before us is left running for it to stop
        lc.stop()


def _prepare_data(root: Path) -> dict:
    return _load("jobdata").prepare(root)


def _overrides(paths: dict) -> list[str]:
    return _load("jobdata").overrides(paths, max_steps=MAX_STEPS)


def _submit(cluster, args: list[str], out: Path, **env) -> str:
    cmd = ["sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cluster.env({**_base_env(), **env}))
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def _base_env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    # The stand-in runs as a script: pretrain must import without relying on how it was installed.
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def _job(cluster, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         env=cluster.env())
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


def _wait(cluster, job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _job(cluster, job_id)
        if info.get("JobState") in FINAL:
            return info
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=cluster.env())
    pytest.fail(f"job {job_id} did not finish in {timeout_s}s: {_job(cluster, job_id)}")


def _train_losses(run_dir: Path) -> dict[int, float]:
    return _load("jobdata").train_losses(run_dir)


def _num_steps(run_dir: Path) -> int:
    return _load("jobdata").num_steps(run_dir)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submit all three jobs at once, preempt the second after STOP_AFTER steps, wait for all."""
    root = tmp_path_factory.mktemp("slurm")
    t0 = time.monotonic()
    paths = _prepare_data(root / "data")
    t_data = time.monotonic()
    cfg = str(REPO / "configs" / "quickstart.yaml")
    runs = {name: root / name for name in ("reference", "preempted", "srun", "requeued", "early")}
    ids = {
        name: _submit(cluster, [str(SBATCH), str(runs[name]), cfg, *_overrides(paths)],
                      root / f"{name}.out", GPUS_PER_NODE="2")
        for name in ("reference", "preempted")
    }
    ids["srun"] = _submit(cluster, ["--ntasks=2", "--wrap",
                                    f"srun python {PAYLOAD} none run_dir={runs['srun']} steps=4"],
                          root / "srun.out")
    ids["requeued"] = _submit(
        cluster, ["--hold", str(SBATCH), str(runs["requeued"]), "none", f"steps={PAYLOAD_STEPS}", "step_time=0.3"],
        root / "requeued.out", GPUS_PER_NODE="2", TRAIN_MODULE=str(PAYLOAD), USR1_RESEND="2")
    # Another job's rendezvous (ids 12768 apart share a port) listens on this one's port on the head node: the
    # script must take the next free port, in both attempts.
    squatter = socket.create_server(("", default_master_port(int(ids["requeued"]))))
    subprocess.run(["scontrol", "release", ids["requeued"]], check=True, env=cluster.env())
    ids["early"] = _submit(
        cluster, [str(SBATCH), str(runs["early"]), "none", f"steps={EARLY_STEPS}", "step_time=0.3",
                  f"slow_start={SLOW_START}"],
        root / "early.out", GPUS_PER_NODE="2", TRAIN_MODULE=str(PAYLOAD), USR1_RESEND="2")
    # preempted: what Slurm does N seconds before the time limit with --signal=B:USR1@N.
    # requeued: what an admin or a preempting job does (SIGTERM to every process, then requeue).
    # early: USR1 while the workers are still starting (they have started, USR1 still ignored for
    # SLOW_START s): the script's resend must reach them once they listen.
    triggers = {"preempted": ["scancel", "--batch", "--signal=USR1", ids["preempted"]],
                "requeued": ["scontrol", "requeue", ids["requeued"]],
                "early": ["scancel", "--batch", "--signal=USR1", ids["early"]]}
    ready = {"preempted": lambda: _num_steps(runs["preempted"]) >= STOP_AFTER,
             "requeued": lambda: _num_steps(runs["requeued"]) >= STOP_AFTER,
             "early": lambda: (runs["early"] / "started-rank0-try0").exists()}
    deadline = time.monotonic() + 240
    while triggers:
        for name in list(triggers):
            if ready[name]():
                subprocess.run(triggers.pop(name), check=True, env=cluster.env())
            else:
                assert _job(cluster, ids[name]).get("JobState") not in FINAL, \
                    (root / f"{name}.out").read_text()[-3000:]
        assert time.monotonic() < deadline, f"{list(triggers)} never reached the signal point"
        time.sleep(0.2)
    t_signal = time.monotonic()
    infos = {name: _wait(cluster, job_id, 300) for name, job_id in ids.items()}
    squatter.close()
    print(f"\n[test_slurm] data {t_data - t0:.0f}s, submit->USR1 {t_signal - t_data:.0f}s, "
          f"USR1->all done {time.monotonic() - t_signal:.0f}s")
    logs = {name: (root / f"{name}.out").read_text() for name in ids}
    return {"runs": runs, "infos": infos, "logs": logs, "ids": ids}


def test_sbatch_runs_two_workers_to_completion(jobs):
    info, log, run = jobs["infos"]["reference"], jobs["logs"]["reference"], jobs["runs"]["reference"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-3000:]
    assert "1 node(s) x 2 worker(s)" in log
    assert "warning: no --cpus-per-task" in log  # submitted without it: the node's task may get one core
    losses = _train_losses(run)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    assert (run / "config.yaml").is_file()
    final = run / "checkpoints" / f"step_{MAX_STEPS:08d}"
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == MAX_STEPS
    assert sorted(p.name for p in final.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]


def test_usr1_checkpoints_requeues_and_resumes_with_identical_losses(jobs):
    info, log, run = jobs["infos"]["preempted"], jobs["logs"]["preempted"], jobs["runs"]["preempted"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "USR1: asking the trainer" in log and "requeueing job" in log
    assert "restart 0:" in log and "restart 1:" in log
    tags = sorted(p.name for p in (run / "checkpoints").glob("step_*") if (p / "trainer_state.json").exists())
    stopped_at = [int(t[5:]) for t in tags if int(t[5:]) < MAX_STEPS]
    assert len(stopped_at) == 1 and STOP_AFTER <= stopped_at[0] < MAX_STEPS, tags  # checkpoint on signal
    reference = _train_losses(jobs["runs"]["reference"])
    resumed = _train_losses(run)
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_srun_without_torchrun_gives_each_task_its_rank(jobs):
    info, log, run = jobs["infos"]["srun"], jobs["logs"]["srun"], jobs["runs"]["srun"]
    assert info["JobState"] == "COMPLETED", log[-3000:]
    envs = [json.loads((run / f"rank{r}-try0.json").read_text())["env"] for r in (0, 1)]
    assert [e["rank"] for e in envs] == [0, 1]
    assert all(e["launcher"] == "slurm" and e["world_size"] == 2 and e["local_world_size"] == 2
               for e in envs)
    assert envs[0]["master_addr"] == envs[1]["master_addr"] and envs[0]["master_port"] == envs[1]["master_port"]
    assert _num_steps(run) == 4


def _payload_reference(steps: int, world_size: int) -> dict[int, float]:
    """The stand-in payload's loss curve computed in one process (float64), rank by rank."""
    import torch

    _batch = _load("payload")._batch

    w_D, losses = torch.zeros(4, dtype=torch.float64), {}
    for step in range(steps):
        grad_D, loss = torch.zeros(4, dtype=torch.float64), 0.0
        for rank in range(world_size):
            x_BD, y_B = _batch(step, rank)
            err_B = x_BD @ w_D - y_B
            grad_D += (x_BD.T @ err_B) * 2 / len(y_B) / world_size
            loss += (err_B ** 2).mean().item() / world_size
        w_D = w_D - 0.05 * grad_D
        losses[step + 1] = loss
    return losses


def test_scontrol_requeue_terminates_checkpoints_and_resumes(jobs):
    info, log, run = jobs["infos"]["requeued"], jobs["logs"]["requeued"], jobs["runs"]["requeued"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "TERM: waiting for the trainer" in log and "restart 1:" in log
    port = default_master_port(int(jobs["ids"]["requeued"]))  # held by the fixture's stand-in for another job
    heads = re.findall(r"head \S+:(\d+) \(the job.s port\),", log)
    assert len(heads) == 2 and all(int(p) != port for p in heads), heads
    stop = json.loads((run / "preempted-try0.json").read_text())
    assert stop["signal"] == 15 and STOP_AFTER <= stop["step"] < PAYLOAD_STEPS
    workers = [json.loads((run / f"rank{r}-try{t}.json").read_text()) for r in (0, 1) for t in (0, 1)]
    assert all(w["usr1_ignored_at_start"] and w["env"]["launcher"] == "torchrun" for w in workers)
    got, want = _train_losses(run), _payload_reference(PAYLOAD_STEPS, 2)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-9), f"step {step}"


def test_usr1_during_worker_startup_is_resent_until_heard(jobs):
    info, log, run = jobs["infos"]["early"], jobs["logs"]["early"], jobs["runs"]["early"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    workers = [json.loads((run / f"rank{r}-try0.json").read_text()) for r in (0, 1)]
    assert all(w["usr1_ignored_at_start"] for w in workers)  # so the first USR1 went unheard
    stop = json.loads((run / "preempted-try0.json").read_text())
    assert stop["signal"] == 10 and 1 <= stop["step"] < EARLY_STEPS
    got, want = _train_losses(run), _payload_reference(EARLY_STEPS, 2)
    assert sorted(got) == sorted(want)
    assert all(got[s] == pytest.approx(want[s], rel=1e-9) for s in want)


def _readme_cpu_example() -> list[str]:
    """The two commands of slurm/README.md's CPU example, as written there."""
    text = (REPO / "slurm" / "README.md").read_text(encoding="utf-8")
    prep = next(ln for ln in text.splitlines() if ln.startswith("python -m pretrain.quickstart runs/tiny"))
    submit = next(ln for ln in text.splitlines()
                  if ln.startswith("GPUS_PER_NODE=2 sbatch --cpus-per-task=2 slurm/pretrain.sbatch"))
    return [prep, submit]


def test_readme_cpu_example_runs_as_written_and_errors_end_in_one_line(cluster, tmp_path):
    """slurm/README.md's CPU example, run from the repository root with runs/tiny -> a temporary directory (and 4
    steps): it completes, its output lands in the run directory (none in the submit directory), and the same job
    without the data paths fails with the trainer's one line naming data.tokenizer, the launcher's one line and
    the script's "failed (exit 2)" -- no torchrun traceback."""
    import shlex

    run = tmp_path / "tiny"
    prep, submit = (ln.replace("runs/tiny", str(run)) for ln in _readme_cpu_example())
    env = cluster.env(_base_env())
    assert prep.startswith("python -m ")
    done = subprocess.run([sys.executable, *shlex.split(prep)[1:]], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    variable, *args = shlex.split(submit)  # GPUS_PER_NODE=2 sbatch --cpus-per-task=2 slurm/pretrain.sbatch RUN CFG ..
    job_env = dict(env, **dict([variable.split("=", 1)]))
    assert args[:3] == ["sbatch", "--cpus-per-task=2", "slurm/pretrain.sbatch"]
    fast = ["train.max_steps=4", "train.eval_every=0", "checkpoint.every=0"]
    bad_run = tmp_path / "no-data"
    ids = {}
    for name, argv in (("ok", [*args[1:], *fast]),
                       ("bad", [*args[1:3], str(bad_run), args[4], "distributed.backend=gloo", *fast])):
        proc = subprocess.run(["sbatch", "--parsable", *argv], cwd=REPO, env=job_env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        ids[name] = proc.stdout.strip().split(";")[0]
    infos = {name: _wait(cluster, job_id, 300) for name, job_id in ids.items()}
    logs = {}
    for name, run_dir in (("ok", run), ("bad", bad_run)):
        out = run_dir / f"slurm-pretrain-{ids[name]}.out"
        assert out.is_file(), sorted(p.name for p in run_dir.iterdir())
        assert not (REPO / f"slurm-pretrain-{ids[name]}.out").exists()
        logs[name] = out.read_text()
    assert infos["ok"]["JobState"] == "COMPLETED", logs["ok"][-3000:]
    assert "training step finished (exit 0)" in logs["ok"] and (run / "checkpoints" / "step_00000004").is_dir()
    # --cpus-per-task reaches the job (its CPUs named on the first line) and silences the one-core warning
    assert "2 CPU(s) a node" in logs["ok"] and "no --cpus-per-task" not in logs["ok"], logs["ok"][:2000]
    bad = logs["bad"]
    assert infos["bad"]["JobState"] == "FAILED" and infos["bad"]["ExitCode"].startswith("2:"), bad[-3000:]
    assert "pretrain-train: error: data.tokenizer is empty" in bad, bad[-3000:]
    # both workers fail on the config; whichever torchrun records first, the other may be its SIGTERM'd peer
    # ("rank 0 killed by SIGTERM, rank 1 exit 2": seen in CI under load), and the launcher's exit is the trainer's 2
    launch = [ln for ln in bad.splitlines() if ln.startswith("[launch] workers stopped: ")]
    assert len(launch) == 1 and re.search(r"rank [01] exit 2\b", launch[0]) and launch[0].endswith("; exit 2"), bad[-3000:]
    assert "training step failed (exit 2)" in bad
    assert "Traceback" not in bad and "ChildFailedError" not in bad, bad[-3000:]
