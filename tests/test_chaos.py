"""benchmarks/chaos.py, run for real on one short case: FSDP2 with sharded asynchronous
checkpoints (the format with the most moving parts), two random SIGKILLs, 30 steps. The full
figure (20 kills per format) is in the README; this keeps the harness and recovery honest. With
killer seed 0 the first kill comes 0.76 s after a step (checkpoints exist by then: the restart
resumes), the second as soon as a checkpoint is being written."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


def test_random_kills_recover_to_the_uninterrupted_runs_final_state(tmp_path):
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "chaos.py", "--cases",
                           "sharded-async", "--kills", "2", "--steps", "30", "--seed", "0",
                           "--json", tmp_path / "rows.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads((tmp_path / "rows.json").read_text())
    assert row["kills"] == 2 and row["restarts"] >= 1, row  # killed, and resumed a checkpoint
    assert row["same_final_state"] and row["same_losses"], row  # bit-identical, every step
    assert "| sharded-async | 2 |" in proc.stdout and "| yes | yes |" in proc.stdout, proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_disk_filled_by_another_process_stops_cleanly_and_resumes_exactly(tmp_path):
    """Another process fills the checkpoint disk (a tmpfs) while the run saves: it stops in one
    line about space, before or during a save, and the same command, once space is freed,
    resumes: the final state is the uninterrupted run's, bit for bit."""
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "chaos.py", "--cases",
                           "disk-full-sharded-async", "--fills", "1", "--steps", "30",
                           "--json", tmp_path / "rows.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads((tmp_path / "rows.json").read_text())
    assert row["fills"] == 1 and row["restarts"] == 1 and row["other_stops"] == 0, row
    assert row["same_final_state"] and row["same_losses"], row
