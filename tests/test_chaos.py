"""benchmarks/chaos.py, run for real on short FSDP2 cases with sharded asynchronous checkpoints
(the format with the most moving parts), 15 steps: a SIGKILL at a random moment; a kill of a
writer process during its background write; and (as root, on a small tmpfs) a disk filled by
another process during a save. (A training process killed during a background write, chaos.py's
async-kill-training-while-writing, is test_faults.py's sharded asynchronous case: the same kill,
resume, bit-for-bit final state and no writer left, with forked workers.) The cases run in one
chaos.py command, which makes their uninterrupted run once. The full figures (20 kills per
format, 5 fills) are in the README; this keeps the harness and recovery honest. The killer waits
for a complete checkpoint, so each restart resumes one; with killer seed 0 the random kill comes
0.76 s after a step, and the kill during a write waits 0.84 s, then for a write to be under way.

One kill per case, 15 steps (until 2026-11-26: two kills, 30 steps, a third of the suite's time
more for this file). Each kill costs a restart of both workers and of their checkpoint writer
processes, four new Pythons that import torch, and recovering from one kill proves what the
second proved again: the restarted workers resume the newest complete checkpoint, passing over
the half-written one, and end with the uninterrupted run's state bit for bit and every printed
loss equal. Restarts from a checkpoint written after a resume, and many kills at random moments,
are chaos.py's own runs (the README's 20 kills per case). Every kill and the disk fill land by
step 6 (measured on 2 busy cores: steps 3-5); a run that ended before its kill would fail the test
(no kill counted), not pass it; after its restart each case trains and saves 9 or more steps."""
import json
import os
import sys

import pytest
from conftest import REPO, Idle

sys.path.insert(0, str(REPO / "benchmarks"))
import chaos as chaos_py  # noqa: E402  (benchmarks/chaos.py: its killer, in this process)

ROOT = os.geteuid() == 0  # mounting a small tmpfs needs root


RUN = {}  # "chaos": the chaos.py command, an Idle run


def start_early(request):
    """Start the chaos.py command at the lowest priority as the session starts (conftest): it runs
    on the cores the other tests leave idle, and this file's tests, which run last, wait for it."""
    if not any("chaos" in getattr(item, "fixturenames", ()) for item in request.session.items):
        return  # none of the tests that read it is selected (pytest -k)
    cwd = request.getfixturevalue("tmp_path_factory").mktemp("chaos")
    cases = ["sharded-async", "async-kill-writer-while-writing",
             *(["disk-full-sharded-async"] if ROOT else [])]
    command = [sys.executable, REPO / "benchmarks" / "chaos.py", "--cases", *cases, "--kills", "1",
               "--fills", "1", "--steps", "15", "--seed", "0", "--json", cwd / "rows.json"]
    RUN["chaos"] = Idle(request, command, cwd)


@pytest.fixture(scope="module")
def chaos():
    """(chaos.py's output, {case: its row})."""
    returncode, stdout, stderr = RUN["chaos"].wait(timeout=900)
    assert returncode == 0, stdout + stderr
    rows = json.loads((RUN["chaos"].cwd / "rows.json").read_text())
    return stdout, {row["case"]: row for row in rows}


def test_random_kills_recover_to_the_uninterrupted_runs_final_state(chaos):
    output, rows = chaos
    row = rows["sharded-async"]
    assert row["kills"] == 1 and row["restarts"] == 1, row  # killed, and resumed a checkpoint
    assert row["same_final_state"] and row["same_losses"], row  # bit-identical, every step
    assert "| sharded-async | 1 |" in output and "| yes | yes |" in output, output


def test_a_writer_killed_during_its_write_loses_nothing(chaos):
    """A checkpoint writer process alone is killed while its asynchronous checkpoint is being
    written: the restart resumes the last complete checkpoint, the run ends with the uninterrupted
    run's state bit for bit, and no process of the run (no writer) is left once it has ended. (A
    training process killed during a write: test_faults.py's sharded asynchronous case.)"""
    row = chaos[1]["async-kill-writer-while-writing"]
    assert row["kills"] == row["during_save"] == 1 and row["restarts"] == 1, row
    assert row["same_final_state"] and row["same_losses"] and row["processes_left"] == 0, row


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_disk_filled_by_another_process_stops_cleanly_and_resumes_exactly(chaos):
    """Another process fills the checkpoint disk (a tmpfs) while the run saves: it stops in one
    line about space, before or during a save, and the same command, once space is freed,
    resumes: the final state is the uninterrupted run's, bit for bit."""
    row = chaos[1]["disk-full-sharded-async"]
    assert row["fills"] == 1 and row["restarts"] == 1 and row["other_stops"] == 0, row
    assert row["same_final_state"] and row["same_losses"], row


# A worker for the killer: the first attempt prints a step and a save, then fails by itself at
# once (exit 1), so torchrun restarts the group; the restart prints nothing and ends.
ENDS_BY_ITSELF = """import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(0.5)
    print("step 1 | Saved", flush=True)
    sys.exit(1)
time.sleep(3)
"""


def test_a_victim_that_ended_by_itself_is_looked_for_again(tmp_path, capsys):
    """chaos.py finds an attempt's workers, waits for a step and a save, then kills one: a worker
    that ended in between (its attempt failed by itself) is no error for the killer, which says so
    and looks again. (A suite of eb0fa8d, 2026-11-30, lost all three chaos tests to a
    ProcessLookupError there.) Killer seed 313 waits 0.97 s after the step, the failed workers
    ending within 0.01 s of it."""
    worker = tmp_path / "worker.py"
    worker.write_text(ENDS_BY_ITSELF)
    returncode, output, kills, _, left = chaos_py.run(worker, [], r"step (\d+)", tmp_path, 2,
                                                      kills=1, seed=313, timeout=60)
    assert returncode == 0 and kills == 0 and left == [], output
    assert "ended before its kill: looking again" in capsys.readouterr().err
