"""Faults: caused from outside the scripts (a worker killed mid-run or mid-checkpoint under
torchrun's elastic restart, a hung peer under a short --dist-timeout), and a bug inside one."""
import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import (
    FSDP2_TINY,
    MNIST_TINY,
    T5_SHARDED,
    TORCHRUN_REPORT,
    checkpoint_writers,
    full_state_of,
    processes_left,
    run_command,
    script_with_lines,
    start_torchrun,
    t5_args,
    torchrun_command,
)


def launch(cwd, script, *args, max_restarts=0):
    """Start torchrun (2 processes) in the background, forked as run_command's are (as new
    processes when forks are off); its output goes to cwd/stdout.txt and cwd/stderr.txt."""
    command = torchrun_command(script, [*args, "--metrics-json", "metrics.json"], 2, max_restarts)
    return start_torchrun(command, cwd, dict(os.environ), (cwd / "stdout.txt", cwd / "stderr.txt"))


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def proc_stat(pid):
    """The fields of /proc/PID/stat after the command name: [state, parent pid, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running_workers(agent, nproc=2):
    """{rank: pid} of the agent's workers, once it has started them."""
    deadline = time.monotonic() + 60
    while len(found := agent.workers()) < nproc:
        assert time.monotonic() < deadline and agent.poll() is None, "the workers did not start"
        time.sleep(0.05)
    return found


def exited(pid):
    try:
        return proc_stat(pid)[0] == "Z"  # a zombie: exited, not yet reaped
    except (FileNotFoundError, ProcessLookupError):  # reaped, before or while /proc was read
        return True


def restarted_after_killing_rank_0(cwd, script, args, caught, writing):
    """Run script under torchrun --max-restarts 1 and SIGKILL its rank 0 as soon as caught()
    returns something, looked at again with rank 0 stopped (a rename may have happened since);
    the restarted run must end well. Returns (what caught saw, stdout)."""
    agent, seen = launch(cwd, script, *args, max_restarts=1), None
    try:
        rank0 = running_workers(agent)[0]
        while seen is None and agent.poll() is None:
            if caught() is None:
                time.sleep(0.0005)
                continue
            os.kill(rank0, signal.SIGSTOP)
            wait_for(lambda: proc_stat(rank0)[0] == "T", 10, "rank 0 to stop")
            seen = caught()
            os.kill(rank0, signal.SIGCONT if seen is None else signal.SIGKILL)
        stdout, stderr = finish(agent, cwd)
    finally:
        stop(agent)
    assert seen is not None, f"the run ended before {writing} could be interrupted"
    assert agent.returncode == 0, stderr
    return seen, stdout


def finish(agent, cwd, timeout=240):
    agent.wait(timeout=timeout)
    return (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()


def stop(agent):
    """Kill torchrun and its workers, a stopped one included, when a test ends before they do."""
    for pid in agent.workers().values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.kill()


@pytest.mark.parametrize("options", [["--dcp-api"],
                                     ["--checkpoint-format", "sharded", "--async-checkpoint"]],
                         ids=["full checkpoints", "sharded asynchronous checkpoints"])
def test_fsdp2_killed_while_checkpointing_restarts_from_the_checkpoint_before(tmp_path,
                                                                              fsdp2_reference,
                                                                              options):
    """torchrun --max-restarts 1; rank 0 (the one that marks checkpoints complete) is SIGKILLed
    while a checkpoint is half-written (for asynchronous ones: while the background write is in
    flight). The restarted workers resume from the newest complete checkpoint and end with the
    uninterrupted run's state, and no process of the run (no checkpoint writer) is left.

    Full checkpoints go through the DCP API here (the reference run used the DTensor API: the files
    must be the same); sharded ones must hold the same tensors. A step_000015 folder is there from
    the start, as a save cut short by an older version would leave it: no COMPLETE marker, a
    truncated model.pt. Resume must pass over it.
    """
    checkpoints = tmp_path / "ckpt"
    (checkpoints / "step_000015").mkdir(parents=True)
    (checkpoints / "step_000015" / "model.pt").write_bytes(b"cut short")

    def half_written_beside_a_complete_one():
        half_written = sorted(checkpoints.glob("step_*.tmp"))
        complete = sorted(p for p in checkpoints.glob("step_*[0-9]")
                          if (p / "COMPLETE").exists())
        return (half_written[0], complete[-1]) if half_written and complete else None

    (half_written, previous), stdout = restarted_after_killing_rank_0(
        tmp_path, "fsdp2_transformer.py",
        [*FSDP2_TINY, "--steps", 20, "--checkpoint-dir", "ckpt", "--save-every", 1, *options],
        half_written_beside_a_complete_one, writing="a checkpoint write")
    step = int(previous.name[5:])
    assert half_written.name == f"step_{step + 1:06d}.tmp"
    assert (f"Ignoring incomplete checkpoint {checkpoints / 'step_000015'} "
            "(no COMPLETE marker)") in stdout
    assert stdout.count(f"No complete checkpoint in --checkpoint-dir {checkpoints}: starting from "
                        "step 0\n") == 1  # the first attempt
    assert f"Resumed from {previous} at step {step}" in stdout  # the restarted one
    # written by the restarted attempt
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["first_step"] == step + 1
            and metrics["losses"] == fsdp2_reference.metrics["losses"][step:])
    assert not list(checkpoints.glob("*.tmp"))
    final = full_state_of(checkpoints / "step_000020")
    expected = full_state_of(fsdp2_reference.cwd / "ckpt" / "step_000020")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert processes_left(tmp_path) == []  # nor the killed rank's checkpoint writer


def start_until_a_writer(cwd, of_rank=None):
    """Start 2 ranks saving asynchronously at every step; return (agent, {rank: pid} of the
    workers, the pids of the checkpoint writers) as soon as a writer (of_rank's) appears."""
    agent = launch(cwd, "fsdp2_transformer.py", *FSDP2_TINY, "--steps", 1000, "--checkpoint-dir",
                   "ckpt", "--save-every", 1, "--checkpoint-format", "sharded",
                   "--async-checkpoint")
    workers = running_workers(agent)
    deadline = time.monotonic() + 60
    parents = set(workers.values()) if of_rank is None else {workers[of_rank]}
    while not (writers := checkpoint_writers(parents)):
        assert agent.poll() is None and time.monotonic() < deadline, "no writer started"
        time.sleep(0.002)
    return agent, workers, writers


def test_a_checkpoint_writer_killed_as_it_starts_ends_the_run_in_one_line(tmp_path):
    """One rank's checkpoint writer process is SIGKILLed as soon as it appears, while it forms
    its process group with the other rank's writer, which then waits for it for ever. The run does
    not hang until --dist-timeout: within seconds every rank stops, with one error line naming the
    dead writer and where a rerun starts, and no process of the run is left."""
    agent, _, writers = start_until_a_writer(tmp_path)
    try:
        os.kill(writers[0], signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = finish(agent, tmp_path, timeout=120)
    finally:
        stop(agent)
    assert agent.returncode != 0 and time.monotonic() - killed < 40, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: cannot start the checkpoint writer processes \(RuntimeError: (Checkpoint "
        r"background process is dead|.*Connection closed by peer.*)\); no complete checkpoint in "
        rf"--checkpoint-dir {re.escape(str(tmp_path / 'ckpt'))} yet: a rerun starts from step 0",
        errors[0]), stderr
    assert processes_left(tmp_path) == []


def test_a_training_process_killed_as_its_writer_starts_leaves_no_writer(tmp_path):
    """Rank 0 is SIGKILLed as soon as its checkpoint writer process appears: torchrun stops the
    other rank (and its writer, in that rank's process group), but the killed rank's writer, left
    waiting to form its group with the other writer, must not outlive the job (30 minutes, its
    rendezvous timeout): within seconds no process of the run is left."""
    agent, workers, _ = start_until_a_writer(tmp_path, of_rank=0)
    try:
        os.kill(workers[0], signal.SIGKILL)
        finish(agent, tmp_path, timeout=120)
    finally:
        stop(agent)
    assert agent.returncode != 0
    assert processes_left(tmp_path, grace=10) == []  # the writer looks for its parent each second


def test_t5_killed_after_an_epoch_restarts_from_its_sharded_checkpoint(tmp_path, t5_reference,
                                                                     tiny_t5_dir, wikihow_dir):
    """torchrun --max-restarts 1 with --resume auto: rank 1 is SIGKILLed once epoch 1's sharded
    checkpoint is complete; the restarted run goes on from it and saves the uninterrupted run's
    epoch-2 model."""
    agent = launch(tmp_path, "t5_fsdp_finetune.py",
                   *t5_args(tiny_t5_dir, wikihow_dir, 2, *T5_SHARDED),
                   "--resume", "auto", max_restarts=1)
    try:
        ranks = running_workers(agent)
        wait_for(lambda: (tmp_path / "checkpoint-epoch-1" / "trainer_state.json").exists(), 120,
                 "epoch 1")
        # freeze both, so that the newest complete checkpoint cannot change
        for pid in ranks.values():
            os.kill(pid, signal.SIGSTOP)
        epochs = [int(p.name.rsplit("-", 1)[1])
                  for p in tmp_path.glob("checkpoint-epoch-*[0-9]")
                  if (p / "trainer_state.json").exists()]
        os.kill(ranks[1], signal.SIGKILL)
        os.kill(ranks[0], signal.SIGCONT)  # torchrun stops it
        stdout, stderr = finish(agent, tmp_path)
    finally:
        stop(agent)
    assert agent.returncode == 0, stderr
    assert f"No complete checkpoint in --save-dir {tmp_path}: starting from epoch 1\n" in stdout
    resumed = tmp_path / f"checkpoint-epoch-{max(epochs)}"  # --save-dir defaults to .
    assert f"Resumed from {resumed} (epoch {max(epochs)} done)" in stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val_losses"] == t5_reference.metrics["val_losses"][:2]
    final = torch.load(metrics["checkpoint_pt"], weights_only=True)  # the best model: epoch 2's
    expected = torch.load(next(t5_reference.cwd.glob("T5-model-*-2-*.pt")), weights_only=True)
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k])
                                                   for k in final)


def test_fsdp2_t5_killed_while_exporting_keeps_the_previous_export(tmp_path, cached_torchrun,
                                                                   tiny_t5_dir, wikihow_dir):
    """FSDP2 exports shard by shard (test_hf_io.py) under --max-restarts 1 and --resume auto:
    rank 0, which consolidates the files and renames the folder, is SIGKILLed while epoch 2's
    export is being written. Epoch 1's export is left as it was and still opens; the killed one
    left only .tmp names, none that from_pretrained would take for a model, and the restarted run
    removes them, resumes from epoch 1's checkpoint and exports the uninterrupted run's epoch-2
    model."""
    from test_hf_io import SHARD_BY_SHARD, assert_same_tensors, hf_tensors
    from transformers import T5ForConditionalGeneration

    args = t5_args(tiny_t5_dir, wikihow_dir, 2, *SHARD_BY_SHARD)
    reference = cached_torchrun("t5_fsdp_finetune.py", *args)  # test_hf_io.py's, uninterrupted
    assert reference.returncode == 0, reference.output
    assert reference.metrics["val_losses"][1] < reference.metrics["val_losses"][0]  # 2 exports

    def epoch_2_written_beside_epoch_1():
        writing = sorted(tmp_path.glob("T5-model-*-2-*.tmp"))
        previous = sorted(tmp_path.glob("T5-model-*-1-*-hf"))
        if writing and previous:
            return writing, previous[0], {f.name: f.read_bytes() for f in previous[0].iterdir()}
        return None

    (writing, previous, files), stdout = restarted_after_killing_rank_0(
        tmp_path, "t5_fsdp_finetune.py",
        [*args, "--checkpoint-type", "sharded", "--resume", "auto"],
        epoch_2_written_beside_epoch_1, writing="an export")
    assert {f.name: f.read_bytes() for f in previous.iterdir()} == files
    T5ForConditionalGeneration.from_pretrained(previous)  # opens
    cut = writing[0].name.split("-hf")[0]  # T5-model-<date>-2-<loss>: the killed attempt's
    assert [p.name for p in tmp_path.glob(f"{cut}*") if not p.name.endswith(".tmp")] == []
    # which the restart removed, under its lock of the folder: nothing unfinished is left
    assert f"unfinished export(s) of an interrupted run: {writing[0].name}" in stdout
    assert not list(tmp_path.glob("*.tmp"))
    assert f"Resumed from {tmp_path / 'checkpoint-epoch-1'} (epoch 1 done)" in stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val_losses"] == reference.metrics["val_losses"]
    assert_same_tensors(hf_tensors(metrics["checkpoint"]),
                        hf_tensors(reference.metrics["checkpoint"]))


def hang_rank_1(cwd, script, args, started):
    """Run script with --dist-timeout HUNG_PEER_TIMEOUT and SIGSTOP its rank 1 once rank 0 has
    printed `started`. Returns (seconds until rank 0 exited, torchrun's exit status, stderr)."""
    agent = launch(cwd, script, *args, "--dist-timeout", HUNG_PEER_TIMEOUT)
    try:
        ranks = running_workers(agent)
        wait_for(lambda: started in (cwd / "stdout.txt").read_text(), 120,
                 f"{script} to start training")
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: exited(ranks[0]), HUNG_PEER_TIMEOUT + 30,
                 f"rank 0 of {script} to give up")
        waited = time.monotonic() - stopped
        # torchrun would only kill a stopped process after its 30 s grace
        os.kill(ranks[1], signal.SIGKILL)
        _, stderr = finish(agent, cwd, timeout=60)
    finally:
        stop(agent)
    return waited, agent.returncode, stderr


# It must also cover T5's rank 1 waiting while rank 0 loads the model and data first, with 4 jobs
# starting at once.
HUNG_PEER_TIMEOUT = 10
HUNG_PEER_SCRIPTS = ["fsdp1_mnist.py", "ddp_mnist.py", "fsdp2_transformer.py",
                     "t5_fsdp_finetune.py"]


@pytest.fixture(scope="module")
def hung_peer_runs(tmp_path_factory, mnist_dir, tiny_t5_dir, wikihow_dir):
    """{script: hang_rank_1(...)} for the four scripts, run at the same time: each mostly waits for
    its timeout."""
    mnist = ["--data-dir", mnist_dir, "--epochs", 50, *MNIST_TINY]
    jobs = {"fsdp1_mnist.py": (mnist, "FSDP built"), "ddp_mnist.py": (mnist, "Train Epoch: 1"),
            "fsdp2_transformer.py": (["--steps", 1_000_000], "step 1 |"),
            "t5_fsdp_finetune.py": ([*t5_args(tiny_t5_dir, wikihow_dir, 50), "--no-save-model"],
                                    "FSDP built")}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {script: pool.submit(hang_rank_1, tmp_path_factory.mktemp("hung"), script, *job)
                   for script, job in jobs.items()}
        return {script: future.result() for script, future in futures.items()}


@pytest.mark.parametrize("script", HUNG_PEER_SCRIPTS)
def test_a_hung_peer_ends_the_job_within_the_timeout(hung_peer_runs, script):
    """Rank 1 is SIGSTOPped mid-training: rank 0's next collective gives up after --dist-timeout
    and the job fails with one line saying so, instead of waiting for ever."""
    waited, returncode, stderr = hung_peer_runs[script]
    assert returncode != 0
    assert HUNG_PEER_TIMEOUT - 1 <= waited < HUNG_PEER_TIMEOUT + 10, waited
    worker_stderr = stderr.split(TORCHRUN_REPORT)[0]
    errors = [line for line in worker_stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in worker_stderr, worker_stderr
    assert errors[0].startswith("error: rank 0: a collective failed (")
    assert f"--dist-timeout {HUNG_PEER_TIMEOUT}s" in errors[0]


def test_a_bug_reaches_torchruns_report_as_the_root_cause(tmp_path):
    """An unexpected exception (here a KeyError put into train_step, as a user's edit might) is
    not turned into an error line: torchrun's failure report shows it, with its traceback, as the
    root cause (the worker's entry point is decorated with @record)."""
    script = script_with_lines("fsdp2_transformer.py", tmp_path,
                               "    optimizer.zero_grad()\n",
                               '    {}["a bug"]\n')
    result = run_command(torchrun_command(script, [*FSDP2_TINY, "--steps", 2], 2), tmp_path, 120)
    report = result.stderr.split("Root Cause (first observed failure):")[-1]
    assert result.returncode != 0
    assert "KeyError: 'a bug'" in report and "in train_step" in report, result.stderr
