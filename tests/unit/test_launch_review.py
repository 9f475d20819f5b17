"""Launch and requeue paths found in review: slurm/pretrain.sbatch and slurm/finetune_glue.sbatch run by bash on fake
SLURM_* environments (srun, scontrol and scancel are small scripts that record what they were asked), and the run
lock on real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "pretrain.sbatch"

# srun stand-in: records its arguments and environment, then exits with $FAKE_RC at once, or (FAKE_WAIT_USR1=1)
# once scancel has forwarded a USR1 to it (what the trainer does: checkpoint, exit 75).
FAKE_SRUN = r"""#!/bin/bash
echo $$ > "$FAKE_DIR/srun.pid"
printf '%s\n' "$@" > "$FAKE_DIR/srun.args"
env > "$FAKE_DIR/srun.env"
if [[ ${FAKE_WAIT_USR1:-0} == 1 ]]; then
    trap 'exit ${FAKE_RC:-75}' USR1
    touch "$FAKE_DIR/srun.ready"
    while true; do sleep 0.05; done
fi
touch "$FAKE_DIR/srun.ready"
exit "${FAKE_RC:-0}"
"""
# scancel stand-in: forwards the signal to the fake step, then takes FAKE_SCANCEL_S seconds (slurmctld's round trip)
FAKE_SCANCEL = r"""#!/bin/bash
echo "$@" >> "$FAKE_DIR/scancel.log"
sig=${1#--signal=}
[[ -f $FAKE_DIR/srun.pid ]] && kill -s "$sig" "$(cat "$FAKE_DIR/srun.pid")" 2>/dev/null
sleep "${FAKE_SCANCEL_S:-0}"
exit 0
"""
# scontrol stand-in: expands hostlists, logs requeues (failing with FAKE_REQUEUE_RC), and with FAKE_HOLD_SHOW_JOB=1
# holds `show job` (the script's first Slurm call) until the test has signalled the batch shell.
FAKE_SCONTROL = r"""#!/bin/bash
echo "$@" >> "$FAKE_DIR/scontrol.log"
case "$1 $2" in
    "show hostnames")
        python -c 'import sys; from pretrain.distributed.env import parse_hostlist as p
print(*p(sys.argv[1]), sep="\n")' "$3" 2>/dev/null ;;
    "show job")
        if [[ ${FAKE_HOLD_SHOW_JOB:-0} == 1 ]]; then
            touch "$FAKE_DIR/show-job.started"
            while [[ ! -f $FAKE_DIR/usr1.sent ]]; do sleep 0.02; done
        fi ;;
    "requeue "*)
        # Slurm's requeue SIGTERMs every process of the batch step, this one among them (FAKE_REQUEUE_TERM=1)
        [[ ${FAKE_REQUEUE_TERM:-0} == 1 ]] && kill -TERM $$ && sleep 0.2
        if [[ ${FAKE_REQUEUE_RC:-0} != 0 ]]; then
            echo "scontrol: error: Requested operation is presently disabled for job $2" >&2
            exit "$FAKE_REQUEUE_RC"
        fi ;;
esac
exit 0
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _slurm_env(tmp_path: Path, **extra) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SRUN_"))
            and k not in ("MASTER_PORT", "MASTER_ADDR", "GPUS_PER_NODE", "CUDA_VISIBLE_DEVICES")}
    return {**base, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_JOB_NUM_NODES": "5",
            "SLURMD_NODENAME": "node01", "SLURM_RESTART_COUNT": "0", "MASTER_PORT": "29999",
            "USR1_RESEND": "1", **extra}  # the resender's sleep holds stdout open until it ends


def _run_sbatch(tmp_path: Path, env: dict, *, usr1: str = "", make_run_dir: bool = True) -> tuple[int, str]:
    """bash slurm/pretrain.sbatch RUN_DIR CONFIG on the fake Slurm. ``usr1``: when the batch shell is sent USR1 (as
    --signal=B:USR1@N does): "step" once the fake step runs, "early" before srun starts (FAKE_HOLD_SHOW_JOB=1)."""
    run_dir = tmp_path / "run"
    if make_run_dir:  # the trainer makes it before anything else
        run_dir.mkdir()
    proc = subprocess.Popen(["bash", str(SBATCH), str(run_dir), "cfg.yaml", "train.max_steps=9"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if usr1:
            mark = tmp_path / ("srun.ready" if usr1 == "step" else "show-job.started")
            deadline = time.monotonic() + 60
            while not mark.exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.02)
            proc.send_signal(signal.SIGUSR1)
            (tmp_path / "usr1.sent").touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out


def _requeued(tmp_path: Path) -> bool:
    log = tmp_path / "scontrol.log"
    return log.exists() and any(ln.startswith("requeue") for ln in log.read_text().splitlines())


def test_a_usr1_stop_is_requeued_and_the_job_ends_0(tmp_path):
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC="75"), usr1="step")
    assert rc == 0 and _requeued(tmp_path), out
    assert "checkpointed and stopped for a requeue (exit 75, as asked by USR1)" in out and "requeueing job 4242" in out
    assert "5 node(s) x 1 worker(s), head node01:29999" in out  # node[01-04,07] expanded: its first host


def test_a_requeue_whose_sigterm_reaches_scontrol_is_still_reported_as_requeued(tmp_path):
    """Slurm's requeue SIGTERMs every process of the batch step: an scontrol that got it before exiting made the
    script say "scontrol requeue failed (no message)" and end as if not requeued (seen once in ~25 runs of
    test_slurm.py); scontrol now runs with TERM ignored."""
    env = _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC="75", FAKE_REQUEUE_TERM="1")
    rc, out = _run_sbatch(tmp_path, env, usr1="step")
    assert rc == 0 and _requeued(tmp_path), out
    assert "requeueing job 4242: requeued" in out and "not requeueing" not in out, out


@pytest.mark.parametrize("visible, gpus_on_node, workers", [("0,1,2,3", "", 4), ("GPU-1a2b,GPU-3c4d", "", 2),
                                                          ("0,1,2,3", "8", 8), ("", "", 1)])
def test_workers_per_node_follow_the_gpus_slurm_gave(tmp_path, visible, gpus_on_node, workers):
    """--gres=gpu:N on a Slurm that sets no SLURM_GPUS_ON_NODE ran one worker on an N-GPU node (the default was 1):
    the devices Slurm made visible to the batch shell count then; SLURM_GPUS_ON_NODE wins where it is set."""
    extra = {k: v for k, v in (("CUDA_VISIBLE_DEVICES", visible), ("SLURM_GPUS_ON_NODE", gpus_on_node)) if v}
    env = _slurm_env(tmp_path, FAKE_RC="0", **extra)
    rc, out = _run_sbatch(tmp_path, env)
    assert rc == 0 and f"5 node(s) x {workers} worker(s)" in out, out
    assert f"--nproc-per-node={workers}" in (tmp_path / "srun.args").read_text() or \
        f"GPUS_PER_NODE={workers}" in (tmp_path / "srun.env").read_text()


@pytest.mark.parametrize("port", ["29999x", "70000", "0", "-5"])
def test_a_master_port_that_is_no_port_ends_the_job_before_srun_naming_it(tmp_path, port):
    """sbatch passes the submitting shell's environment on: a MASTER_PORT set there reaches the job as given."""
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_RC="0", MASTER_PORT=port))
    assert rc == 2 and f"MASTER_PORT={port} is not a port number (1-65535); unset it" in out, out
    assert not (tmp_path / "srun.args").exists()


def test_a_master_port_in_use_on_the_head_node_ends_the_job_before_srun_saying_why(tmp_path):
    """An inherited MASTER_PORT that another job holds failed at the rendezvous (torchrun's 'address already in
    use', after every node had started); it is now checked on the head node before srun, where the job's own port
    would have moved on to a free one. The banner says where the port came from."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_RC="0", MASTER_PORT=str(port)))
        assert rc == 2 and f"MASTER_PORT={port} is in use on node01" in out and "unset it" in out, out
        assert not (tmp_path / "srun.args").exists()
        # off the head node the batch shell cannot tell: the port is taken as given
        rc, out = _run_sbatch(tmp_path / "off", _slurm_env(_mkdir(tmp_path / "off"), FAKE_RC="0",
                                                             MASTER_PORT=str(port), SLURMD_NODENAME="node02"))
        assert rc == 0 and f"head node01:{port} (MASTER_PORT from the environment)" in out, out


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def test_a_run_that_finished_as_usr1_came_is_not_requeued(tmp_path):
    """The warning came in the last minutes and the trainer finished train.max_steps (exit 0): requeueing would only
    queue the whole allocation again to load the final checkpoint and stop."""
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC="0"), usr1="step")
    assert rc == 0 and not _requeued(tmp_path), out
    assert "training step finished (exit 0)" in out and "not requeueing: the run finished" in out


@pytest.mark.parametrize("code", [2, 4])
def test_after_usr1_an_exit_that_needs_a_fix_is_not_requeued(tmp_path, code):
    """docs/operations.md's exit codes 2 (config/input) and 4 (checkpoint/metrics not writable): "fix it and
    relaunch". A requeue repeats the failure (for 4 after hours of training that cannot be saved)."""
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC=str(code)), usr1="step")
    assert rc == code and not _requeued(tmp_path), out
    assert f"not requeueing: exit {code} needs a fix" in out


@pytest.mark.parametrize("why, extra, words", [
    ("max_requeues", {"SLURM_RESTART_COUNT": "5", "MAX_REQUEUES": "5"}, "already restarted 5 times"),
    ("scontrol_refuses", {"FAKE_REQUEUE_RC": "1"}, "scontrol requeue 4242 failed (scontrol: error: Requested"),
])
def test_a_stop_that_is_not_requeued_does_not_end_completed(tmp_path, why, extra, words):
    """A USR1 stop the script does not requeue (MAX_REQUEUES; a job submitted with --no-requeue, where scontrol
    refuses) has not finished the run: the job must not end COMPLETED with exit 0, where an `afterok` dependency
    (conversion, evaluation) would start on a half-trained run. Exit 1 (not 75, which a site's RequeueExit=75 would
    requeue after all)."""
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC="75", **extra), usr1="step")
    assert rc == 1, out
    assert "not requeueing: " + words in out
    assert "requeueing job 4242: requeued" not in out


def test_a_step_that_exits_while_the_usr1_trap_runs_keeps_its_exit_code(tmp_path):
    """scancel (a round trip to slurmctld, here 1 s) runs inside the USR1 trap, which interrupted `wait`; the step
    exits meanwhile. Its code is 75, not the interrupted wait's 128 + SIGUSR1 = 138."""
    env = _slurm_env(tmp_path, FAKE_WAIT_USR1="1", FAKE_RC="75", FAKE_SCANCEL_S="1")
    rc, out = _run_sbatch(tmp_path, env, usr1="step")
    assert "exit 138" not in out, out
    assert "checkpointed and stopped for a requeue (exit 75, as asked by USR1)" in out and _requeued(tmp_path), out


def test_a_usr1_before_the_step_requeues_even_before_the_run_dir_exists(tmp_path):
    """A USR1 before srun started (a time limit shorter than --signal's lead, an early `scancel --batch`) requeues at
    once; with --output given, nothing has made RUN_DIR yet, and the requeue record must not fail on it."""
    rc, out = _run_sbatch(tmp_path, _slurm_env(tmp_path, FAKE_HOLD_SHOW_JOB="1"), usr1="early", make_run_dir=False)
    assert not (tmp_path / "srun.args").exists(), out  # the step never started
    assert rc == 0 and _requeued(tmp_path), out
    assert "Traceback" not in out and (tmp_path / "run" / "requeues.jsonl").is_file()


def test_the_glue_array_task_hands_its_cpus_to_srun(tmp_path):
    """Since Slurm 22.05 srun no longer reads SLURM_CPUS_PER_TASK: the header's --cpus-per-task=8 did not reach the
    task, which got one core where the cluster binds tasks (slurm/README.md; pretrain.sbatch sets SRUN_CPUS_PER_TASK
    for the same reason). A value the user set is kept."""
    script = REPO / "slurm" / "finetune_glue.sbatch"
    env = _slurm_env(tmp_path, SLURM_ARRAY_TASK_ID="3", SLURM_CPUS_PER_TASK="8")
    proc = subprocess.run(["bash", str(script), "--tasks", "rte"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "SRUN_CPUS_PER_TASK=8" in (tmp_path / "srun.env").read_text().splitlines()
    proc = subprocess.run(["bash", str(script), "--tasks", "rte"], env={**env, "SRUN_CPUS_PER_TASK": "4"},
                          capture_output=True, text=True, timeout=60)
    assert "SRUN_CPUS_PER_TASK=4" in (tmp_path / "srun.env").read_text().splitlines()


# -- the run lock ------------------------------------------------------------------------------------------------


def _acquire_in_child(run_dir: Path, go: float, out: Path) -> int:
    """Fork a process that spins until ``go`` then tries to take ``run_dir``'s lock, writing WON or LOST to ``out``
    (forked, not spawned: the race needs many tries, and a fresh interpreter takes a second to import torch)."""
    from pretrain.training.run_lock import RunDirLocked, RunLock

    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        lock = RunLock(run_dir, heartbeat_s=60, stale_after_s=5)
        while time.time() < go:
            pass
        try:
            warning = lock.acquire()
            out.write_text("WON")
            out.with_suffix(".why").write_text(str(warning))
            time.sleep(0.1)  # held while the other decides
        except RunDirLocked:
            out.write_text("LOST")
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def test_two_trainers_starting_at_once_never_both_take_the_lock(tmp_path):
    """Two jobs pointed at one run directory that start together: the first creates run.lock, which was empty from
    its O_EXCL create until its write, and the second, reading it in that instant, took it over as "unreadable";
    the first still believed it held the lock until its next heartbeat (30 s). Measured 4 of 40 tries with two
    fresh processes. Exactly one may win."""
    both = []
    for trial in range(30):
        run_dir = tmp_path / f"t{trial}"
        go = time.time() + 0.05
        outs = [tmp_path / f"t{trial}-{k}" for k in (0, 1)]
        pids = [_acquire_in_child(run_dir, go, out) for out in outs]
        for pid in pids:
            assert os.waitpid(pid, 0)[1] == 0
        results = sorted(out.read_text() for out in outs)
        assert results in (["LOST", "WON"], ["WON", "WON"]), results
        if results == ["WON", "WON"]:
            both.append(trial)
    assert not both, f"both trainers took the lock in trials {both}"
    leftovers = [p.name for p in tmp_path.rglob(".run.lock*")]
    assert not leftovers, leftovers


def test_a_lock_unreadable_for_a_moment_is_read_again_before_it_is_taken_over(tmp_path, monkeypatch):
    """An unreadable run.lock (a read that failed while its holder on another host rewrote it, on NFS; a lock still
    being written) was taken over at once, ending a live holder's run at its next heartbeat. It is read again for
    a moment first: here it becomes a live holder's lock, which is then watched and refused."""
    from pretrain.training.run_lock import LOCK_NAME, RunDirLocked, RunLock

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("PRETRAIN_JOB_ID", raising=False)
    (tmp_path / LOCK_NAME).write_text("")
    stop = threading.Event()

    def holder():  # another host's trainer: its lock appears 0.3 s later and its heartbeat keeps changing
        n = 0
        stop.wait(0.3)
        while not stop.is_set():
            n += 1
            tmp = tmp_path / ".holder"
            tmp.write_text(json.dumps({"host": "node-7", "pid": 4242, "job": "slurm:11", "since": 0,
                                       "token": "someone", "beats": n, "heartbeat": n}))
            os.replace(tmp, tmp_path / LOCK_NAME)
            stop.wait(0.05)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    try:
        with pytest.raises(RunDirLocked, match="in use by another trainer: host node-7, pid 4242, job slurm:11"):
            RunLock(tmp_path, heartbeat_s=0.2, stale_after_s=5).acquire()
    finally:
        stop.set()
        thread.join()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "someone"


def test_the_lock_is_still_taken_where_the_filesystem_has_no_hard_links(tmp_path, monkeypatch):
    """Some FUSE and SMB mounts refuse link(2) (EPERM): the lock falls back to the exclusive create, which still
    does not overwrite a lock that is there."""
    from pretrain.training.run_lock import LOCK_NAME, RunLock

    def no_links(src, dst, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(os, "link", no_links)
    lock = RunLock(tmp_path, heartbeat_s=60)
    assert lock.acquire() is None
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    assert RunLock(tmp_path)._create() is False
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()
    assert not list(tmp_path.iterdir())


# -- stop signals ------------------------------------------------------------------------------------------------

BLOCKED_PRINT = r"""import os, signal, sys, threading, time
from pretrain.distributed.signals import StopSignal
r, w = os.pipe()
sys.stderr = open(w, "w", buffering=1)  # line-buffered text over a pipe, as srun forwards a rank's stderr
stop = StopSignal()
got = []
def slurm_then_reader():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGUSR1)  # the resent USR1 lands while the main thread is blocked in a print
    time.sleep(0.3)
    while True:  # then the reader (slurmstepd) catches up
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        got.append(chunk)
reader = threading.Thread(target=slurm_then_reader)
reader.start()
try:
    print("x" * (1 << 20), file=sys.stderr, flush=True)  # more than the pipe holds: blocks until read
    outcome = "print finished"
except BaseException as e:
    outcome = f"{type(e).__name__}: {e}"
sys.stderr.close()
reader.join()
text = b"".join(got).decode()
print(outcome, f"requested={stop.requested}", "message=" + str("received SIGUSR1: will checkpoint" in text))
"""


def test_a_stop_signal_during_a_blocked_print_does_not_crash_the_trainer(tmp_path):
    """A rank's stderr is a pipe to srun; when it is full the trainer's print blocks, and a USR1 then (the batch
    script resends it every USR1_RESEND s) ran the handler inside that print: its own print to the same stream
    raised "RuntimeError: reentrant call inside <_io.BufferedWriter>" in the trainer's main thread, which died
    instead of checkpointing. The handler writes to the descriptor itself."""
    script = tmp_path / "blocked_print.py"
    script.write_text(BLOCKED_PRINT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["print", "finished", "requested=True", "message=True"], proc.stdout
