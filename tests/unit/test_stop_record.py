"""pretrain.training.stop_record: the trainer's record of a signal stop, read back only by the same launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pretrain.training.stop_record import STOP_RECORD, main, recorded_code, write_stop_record

REPO = Path(__file__).resolve().parents[2]


def test_the_record_is_this_launchs_only(tmp_path):
    job = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}
    write_stop_record(tmp_path, code=75, step=12, checkpoint="ck/step_00000012", environ=job)
    record = json.loads((tmp_path / STOP_RECORD).read_text())
    assert record["job"] == "slurm:41" and record["restart"] == 2 and record["step"] == 12 and record["code"] == 75
    assert recorded_code(tmp_path, job) == 75
    assert recorded_code(tmp_path, {**job, "SLURM_RESTART_COUNT": "3"}) is None  # the requeued launch after it
    assert recorded_code(tmp_path, {**job, "SLURM_JOB_ID": "42"}) is None  # another job on the same run_dir
    assert recorded_code(tmp_path, {}) is None  # outside a job, launches cannot be told apart
    array = {"SLURM_JOB_ID": "50", "SLURM_ARRAY_JOB_ID": "49", "SLURM_ARRAY_TASK_ID": "3"}
    write_stop_record(tmp_path, code=130, step=3, checkpoint="c", environ=array)
    assert recorded_code(tmp_path, array) == 130 and recorded_code(tmp_path, job) is None
    assert recorded_code(tmp_path, {**array, "SLURM_ARRAY_TASK_ID": "4"}) is None
    assert not [p.name for p in tmp_path.iterdir() if p.name != STOP_RECORD]  # no temporary file left


def test_missing_or_damaged_records_are_no_record(tmp_path):
    job = {"SLURM_JOB_ID": "41"}
    assert recorded_code(tmp_path, job) is None
    for text in ("", "{", "[]", '{"job": "slurm:41", "restart": 0}', '{"job": "slurm:41", "restart": 0, "code": "75"}'):
        (tmp_path / STOP_RECORD).write_text(text)
        assert recorded_code(tmp_path, job) is None, text


def test_command_line_prints_the_code_and_exits_0_only_for_this_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SLURM_JOB_ID": "7"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pretrain.training.stop_record", str(tmp_path)]
    none = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert none.returncode == 1 and none.stdout == ""
    write_stop_record(tmp_path, code=75, step=1, checkpoint="c", environ={"SLURM_JOB_ID": "7"})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "75", done.stderr
    other = subprocess.run(cmd, env=env | {"SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True)
    assert other.returncode == 1 and other.stdout == ""
    assert main([]) == 2


def test_requeues_go_on_while_the_run_checkpoints_and_stop_when_it_stalls(tmp_path):
    """The batch script's self-requeue (USR1 before each time limit): weeks of them are fine while the latest
    checkpoint moves (MAX_REQUEUES was 50, which a 4-hour limit reached in ~8 days); three in a row that leave it
    where it was stop (a job stopped each time before it checkpoints anything new). Other jobs' requeues on the same
    run directory, and a cut line, do not count."""
    from pretrain.training.stop_record import REQUEUES, requeue_allowed

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()

    def requeue(restart: int, step: int | None, job: str = "41"):
        if step is not None:
            (ckpts / "latest").write_text(f"step_{step:08d}\n")
        return requeue_allowed(tmp_path, max_stalled=3,
                               environ={"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart)})

    assert all(requeue(r, 1000 * (r + 1))[0] for r in range(60))  # 60 requeues, each after progress
    assert requeue(60, 61_000)[0] and requeue(61, None)[0] and requeue(62, None)[0]  # two stalled: still fine
    ok, why = requeue(63, None)  # the third requeue in a row that moved nothing
    assert not ok and "did not move over the last 3 requeues" in why and "step 61000" in why
    with open(tmp_path / REQUEUES, "a") as f:
        f.write('{"job": "slurm:41", "rest')  # cut by a kill
    assert requeue(0, 61_000, job="77")[0]  # another job's history is its own
    last = (tmp_path / REQUEUES).read_text().splitlines()[-1]  # on a line of its own, not glued to the cut one
    assert json.loads(last)["job"] == "slurm:77"
    code = subprocess.run([sys.executable, "-m", "pretrain.training.stop_record", "--requeue", str(tmp_path),
                           "--max-stalled", "3"], env={**os.environ, "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "64"},
                          capture_output=True, text=True, cwd=REPO)
    assert code.returncode == 1 and "did not move" in code.stdout, code.stderr
