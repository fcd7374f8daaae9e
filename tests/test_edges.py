"""The edges of a long run: a disk that fills during a save, and Ctrl-C or SIGTERM. Each ends in
one line that names the cause (no worker traceback), keeps the last complete checkpoint, and
leaves nothing running.

A full disk is real: a small tmpfs that the test mounts (root only; skipped otherwise). The
scripts check the free space before each save; a copy of a script without that check meets the
disk filling up (ENOSPC) during the write itself, as when another process fills the disk. The
suite itself stops at once where its own folder's disk has too little room."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    DISK_NEEDED_GB,
    FSDP2_TINY,
    MNIST_TINY,
    REPO,
    full_state_of,
    processes_left,
    run_command,
    script_with_lines,
    single_error_line,
    start_torchrun,
    t5_args,
    torchrun_arguments,
    torchrun_command,
)
from forked_torchrun import forks, start_python

FSDP2_SAVING = [*FSDP2_TINY, "--steps", 20, "--save-every", 5, "--checkpoint-dir", "ckpt"]
FORMATS = {"full": [], "sharded": ["--checkpoint-format", "sharded"],
           "sharded async": ["--checkpoint-format", "sharded", "--async-checkpoint"]}
# Two MiB hold one checkpoint of FSDP2_TINY (0.6 MB) and the MiB the scripts keep to spare.
SMALL_DISK = "2m"


@pytest.fixture
def small_disk(tmp_path):
    """mount(folder, size): a tmpfs of that size at folder (made), unmounted after the test."""
    mounted = []

    def mount(folder, size):
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", folder], check=False)


def complete_checkpoints(folder):
    return sorted(p.name for p in folder.iterdir() if (p / "COMPLETE").exists())


@pytest.mark.parametrize("options", list(FORMATS.values())[:2], ids=list(FORMATS)[:2])
def test_fsdp2_refuses_a_save_the_disk_cannot_hold(tmp_path, small_disk, options):
    """The checkpoint of step 5 fits on the disk, that of step 10 would not: the run stops before
    writing it, in one line with the folder, the bytes needed and free, what to do, and the
    checkpoint a rerun resumes from, which is complete."""
    small_disk(tmp_path / "ckpt", SMALL_DISK)
    result = run_command(torchrun_command("fsdp2_transformer.py", [*FSDP2_SAVING, *options], 2),
                         tmp_path, timeout=120)
    line = single_error_line(result)
    assert result.returncode != 0
    assert re.search(rf"not enough space to save into {tmp_path / 'ckpt'}: the save needs "
                     r"0\.\d MiB, [01]\.\d MiB are free; free space there", line), line
    assert f"the last complete checkpoint is step 5 ({tmp_path / 'ckpt' / 'step_000005'})" in line
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000005"]
    assert complete_checkpoints(tmp_path / "ckpt") == ["step_000005"]
    assert full_state_of(tmp_path / "ckpt" / "step_000005")
    assert processes_left(tmp_path) == []


@pytest.mark.parametrize("options", FORMATS.values(), ids=FORMATS.keys())
def test_fsdp2_disk_filling_during_a_save(tmp_path, small_disk, options):
    """Without the free-space check (as when another process fills the disk meanwhile), the
    write itself fails with ENOSPC: one line from the rank that met it, which says so, the
    half-written folder removed, the checkpoints before kept and complete."""
    small_disk(tmp_path / "ckpt", SMALL_DISK)
    script = script_with_lines("fsdp2_transformer.py", tmp_path,
                               "def space_problem(folder, needed, elsewhere):\n",
                               "    return None  # as if the disk had room when checked\n")
    result = run_command(torchrun_command(script, [*FSDP2_SAVING, *options], 2), tmp_path,
                         timeout=120)
    line = single_error_line(result)
    assert result.returncode != 0
    assert re.search(rf"cannot write {tmp_path / 'ckpt' / 'step_0000'}\d\d \(no space left on "
                     rf"the device; 0\.\d MiB free in {tmp_path / 'ckpt'}", line), line
    assert "the last complete checkpoint is step" in line
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved and saved == complete_checkpoints(tmp_path / "ckpt")  # no .tmp left
    assert f"the last complete checkpoint is step {int(saved[-1][5:])} " in line
    assert processes_left(tmp_path) == []


@pytest.mark.parametrize("script", ["fsdp1_mnist.py", "ddp_mnist.py"])
def test_mnist_save_model_on_a_full_disk(tmp_path, small_disk, mnist_dir, script):
    """mnist_cnn.pt (4.8 MB) is refused on a disk of 4 MiB, in one line; with the check gone, the
    write fails with ENOSPC (put there by a line added to a copy of the script): one line too,
    and no half-written file."""
    cwd = small_disk(tmp_path / "run", "4m")
    args = ["--data-dir", mnist_dir, "--epochs", 1, "--dry-run", *MNIST_TINY, "--save-model"]
    refused = run_command(torchrun_command(script, args, 2), cwd, timeout=120)
    line = single_error_line(refused)
    assert re.search(rf"not enough space to save into {cwd}: the save needs 4\.6 MiB, \d\.\d MiB "
                     r"are free; .* or run it in another folder", line), line
    copy = script_with_lines(  # save_model's gather done, its write fails
        script, tmp_path, "    state = get_model_state_dict(model, options=options)\n",
        "    if dist.get_rank() == 0:\n"
        "        import errno\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f'{path}.tmp')\n")
    cwd = tmp_path / "roomy"  # the check passes; then the injected ENOSPC
    cwd.mkdir()
    failed = run_command(torchrun_command(copy, args, 2), cwd, timeout=120)
    line = single_error_line(failed)
    assert f"cannot write {cwd / 'mnist_cnn.pt'} (no space left on the device;" in line, line
    assert sorted(p.name for p in cwd.iterdir()) == []


def test_t5_saves_on_a_full_disk(tmp_path, small_disk, tiny_t5_dir, wikihow_dir):
    """On a 1.7 MiB disk the exported model (.pt and -hf, 0.5 MB) fits, the sharded checkpoint
    after it (1.3 MB) would not: refused in one line, the export complete. Without the check (a
    copy of the script), the checkpoint's DCP write meets ENOSPC: one line, no .tmp left."""
    out = small_disk(tmp_path / "out", "1800k")
    args = t5_args(tiny_t5_dir, wikihow_dir, 1, "--checkpoint-type", "sharded")
    refused = run_command(torchrun_command("t5_fsdp_finetune.py", [*args, "--save-dir", out], 2),
                          tmp_path, timeout=180)
    line = single_error_line(refused)
    assert re.search(rf"not enough space to save into {out}: the save needs 0\.\d MiB, 1\.\d MiB "
                     r"are free; .* or pass another --save-dir; no complete checkpoint in "
                     rf"--save-dir {out} yet: a rerun starts from epoch 1$", line), line
    exported = sorted(p.name for p in out.iterdir())
    assert len(exported) == 2 and exported[0].endswith("-hf") and exported[1].endswith(".pt")
    copy = script_with_lines("t5_fsdp_finetune.py", tmp_path,
                             "def space_problem(folder, needed, elsewhere):\n",
                             "    return None  # as if the disk had room when checked\n")
    shutil.copy(REPO / "summarization_dataset.py", tmp_path)
    out = small_disk(tmp_path / "out2", "1m")
    failed = run_command(torchrun_command(copy, [*args, "--save-dir", out], 2), tmp_path, 180)
    line = single_error_line(failed)
    assert re.search(rf"cannot write {out / 'checkpoint-epoch-1'}\S* \(no space left on the "
                     r"device; 0\.\d MiB free", line), line
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert processes_left(tmp_path) == []


def test_t5_unfinished_export_that_cannot_go_stops_in_one_line(tmp_path, small_disk, tiny_t5_dir,
                                                                 wikihow_dir):
    """A run that holds --save-dir (sharded checkpoints) removes the unfinished exports an
    interrupted attempt left (test_faults.py); one it cannot remove (here a mount point: EBUSY)
    stops every rank before training, in one line that names it, and the rest stays."""
    out = tmp_path / "out"
    unfinished = small_disk(out / "T5-model-2026-01-01-000000-2-1.0000-hf.tmp", "1m")
    (unfinished / "model.safetensors").write_bytes(b"half written")
    args = t5_args(tiny_t5_dir, wikihow_dir, 1, "--checkpoint-type", "sharded", "--save-dir", out)
    result = run_command(torchrun_command("t5_fsdp_finetune.py", args, 2), tmp_path, timeout=180)
    line = single_error_line(result)
    assert result.returncode != 0
    assert (f"cannot remove {unfinished}, an unfinished export of an interrupted run (Device or "
            "resource busy); remove it, or pass another --save-dir") in line, line
    assert "Train Epoch" not in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [unfinished.name]


def start(cwd, command):
    """Start command (torchrun's, or `python script.py`'s) in cwd in a session of its own, as a
    terminal starts a job (Ctrl-C signals its process group), its output in cwd/stdout.txt and
    cwd/stderr.txt. Forked as run_command's runs are: importing torch and the script's modules is
    3-7 s of CPU per process that starts anew (the suite is CPU-bound); with FSDP_TESTS_FORK=0,
    new processes, as a user starts them."""
    command, env = [str(c) for c in command], dict(os.environ)
    outputs = (cwd / "stdout.txt", cwd / "stderr.txt")
    for path in outputs:  # there to read at once (a forked agent opens them as it starts)
        path.write_text("")
    if torchrun_arguments(command) is not None:  # workers() lists its workers
        return start_torchrun(command, cwd, env, outputs, new_session=True)
    if forks(env) and command[0] == sys.executable and (
            job := start_python(command[1:], cwd, env, outputs)):
        return job
    with open(outputs[0], "w") as out, open(outputs[1], "w") as err:
        return subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, start_new_session=True)


def interrupt_after(job, cwd, text, signum, to_group=True):
    """Send signum (to the job's process group, as Ctrl-C does, or to the launcher only) once
    text is in its stdout; returns (exit status, stdout, stderr, the pids of torchrun's workers
    that were in the group signalled: none, for a launcher that is not torchrun)."""
    deadline = time.monotonic() + 120
    while text not in (cwd / "stdout.txt").read_text():
        assert job.poll() is None and time.monotonic() < deadline, (cwd / "stderr.txt").read_text()
        time.sleep(0.05)
    workers = job.workers().values() if hasattr(job, "workers") else []
    in_group = [pid for pid in workers if os.getpgid(pid) == job.pid]
    (os.killpg if to_group else os.kill)(job.pid, signum)
    job.wait(timeout=60)
    return (job.returncode, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text(),
            in_group)


INTERRUPTED = re.compile(r"interrupted by (SIGINT|SIGTERM) at step (\d+); the last complete "
                         r"checkpoint is step (\d+) \((\S+)\): run the same command to resume")


@pytest.mark.parametrize("launcher, signum, to_group", [
    ("torchrun", signal.SIGINT, True),
    ("python", signal.SIGINT, True),
    ("python", signal.SIGTERM, False),
], ids=["Ctrl-C under torchrun", "Ctrl-C under python", "SIGTERM to python"])
def test_fsdp2_interrupted(tmp_path, launcher, signum, to_group):
    """One line names the step and the checkpoint a rerun resumes from; no worker traceback; the
    exit status of a process killed by the signal (python; torchrun's own is 1); no asynchronous
    save left without its marker; nothing left running; and the rerun resumes from it.

    Ctrl-C under torchrun is also `kill -INT` of torchrun alone (once a case of its own, with the
    same assertions): torchrun starts each worker in a session of its own, so its process group,
    which Ctrl-C signals, holds none of them (asserted), and torchrun passes the signal on."""
    args = [*FSDP2_TINY, "--steps", 100_000, "--save-every", 3, "--checkpoint-dir", "ckpt",
            "--checkpoint-format", "sharded", "--async-checkpoint"]
    command = (torchrun_command("fsdp2_transformer.py", args, 2) if launcher == "torchrun" else
               [sys.executable, REPO / "fsdp2_transformer.py", *args, "--world-size", 2])
    status, stdout, stderr, in_group = interrupt_after(start(tmp_path, command), tmp_path,
                                                       "Saved checkpoint ckpt/step_000006",
                                                       signum, to_group)
    assert in_group == []
    lines = [line for line in stderr.splitlines() if INTERRUPTED.search(line)]
    assert len(lines) == 1, stderr
    name, step, saved, path = INTERRUPTED.search(lines[0]).groups()
    assert name == signum.name and int(step) >= 6 and int(saved) >= 6
    if launcher == "python":
        assert status == 128 + signum and stderr.strip() == lines[0]
    else:  # torchrun says it stops the workers, and ends in its own traceback (SignalException)
        assert status == 1 and stderr.count("Traceback") == 1 and "SignalException" in stderr
        assert stderr.index(lines[0]) < stderr.index("Traceback")
    folder = tmp_path / "ckpt"
    assert complete_checkpoints(folder)[-1] == f"step_{int(saved):06d}" == os.path.basename(path)
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp")) == (
        complete_checkpoints(folder))
    assert processes_left(tmp_path) == []
    if launcher == "python" and signum == signal.SIGINT:
        # The rerun: one step, enough to say where it resumed, saved without the background
        # writers (a new Python each: 11 s of CPU for the two), which the interrupted run tested.
        args[args.index("--steps") + 1] = int(saved) + 1
        args.remove("--async-checkpoint")
        resumed = run_command(torchrun_command("fsdp2_transformer.py", args, 2), tmp_path, 120)
        assert f"Resumed from {folder / f'step_{int(saved):06d}'} at step {saved}" in (
            resumed.stdout), resumed.output


def test_mnist_interrupted_says_it_starts_over(tmp_path, mnist_dir):
    """Ctrl-C of torchrun during an MNIST run: rank 0's line says that a rerun starts over (MNIST
    keeps no checkpoint); torchrun's own traceback is the only one; nothing left running."""
    job = start(tmp_path, torchrun_command("ddp_mnist.py", ["--data-dir", mnist_dir, "--epochs",
                                                            100, *MNIST_TINY], 2))
    status, stdout, stderr, _ = interrupt_after(job, tmp_path, "Train Epoch: 1", signal.SIGINT)
    assert "interrupted by SIGINT; MNIST runs keep no checkpoint: a rerun starts from epoch 1" in (
        stderr.splitlines()), stderr
    assert stderr.count("Traceback") == 1 and processes_left(tmp_path) == []


def test_t5_interrupted_under_python_says_where_to_resume(tmp_path, tiny_t5_dir, wikihow_dir):
    """Ctrl-C of `python t5_fsdp_finetune.py` after its first sharded checkpoint: one line naming
    it, the exit status of SIGINT, and no other output on stderr than the progress bars (no
    resource-tracker report of leaked semaphores: the workers end through os._exit)."""
    command = [sys.executable, REPO / "t5_fsdp_finetune.py",
               *t5_args(tiny_t5_dir, wikihow_dir, 1000), "--checkpoint-type", "sharded",
               "--save-dir", "ckpt", "--cpu"]
    status, stdout, stderr, _ = interrupt_after(start(tmp_path, command), tmp_path,
                                                "Saved sharded checkpoint", signal.SIGINT)
    assert status == 128 + signal.SIGINT, stderr
    bars = re.compile(r"(r0 Training|Validation) Epoch")  # each loop's final progress bar
    said = [line for line in stderr.splitlines() if not bars.match(line)]
    assert len(said) == 1 and re.fullmatch(
        r"interrupted by SIGINT in (Training Epoch \d+|Validation Epoch); the last complete "
        rf"checkpoint is epoch (\d+) \({re.escape(str(tmp_path / 'ckpt'))}/checkpoint-epoch-\2\): "
        "run the same command with --resume auto to resume", said[0]), stderr
    assert processes_left(tmp_path) == []


@pytest.mark.parametrize("script", ["fsdp2_transformer.py", "ddp_mnist.py"])
def test_a_bug_under_python_shows_its_traceback(tmp_path, mnist_dir, script):
    """An exception no safeguard knows (a bug put into main) in a process that `python SCRIPT.py`
    started: its traceback reaches stderr and the run exits 1. (mp.spawn keeps a worker's
    traceback for a join() that the launcher does not call: such a run ended with status 1 and
    not a word.) One spawned worker shows it as well as two: each is a new Python, which imports
    torch and the script's modules (3-7 s of CPU)."""
    copy = script_with_lines(script, tmp_path, "def main(args, device):\n",
                             "    raise ValueError('a bug that no safeguard knows')\n")
    args = ["--steps", 1] if script.startswith("fsdp2") else ["--data-dir", mnist_dir]
    run = run_command([sys.executable, copy, "--cpu", "--world-size", 1, *args], tmp_path,
                      timeout=120)
    assert run.returncode == 1, run.output
    assert "Traceback (most recent call last)" in run.stderr, run.output
    assert "ValueError: a bug that no safeguard knows" in run.stderr, run.output
    assert processes_left(tmp_path) == []


def test_the_suite_stops_at_once_on_a_disk_without_room(tmp_path, small_disk):
    """pytest with a temporary folder on a disk without the room the suite needs stops before any
    test, in one line that says so, where tests would fail one by one with ENOSPC."""
    disk = small_disk(tmp_path / "disk", "64m")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                             "--basetemp", disk / "basetemp", "tests/test_layout.py"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert re.search(rf"the tests need {DISK_NEEDED_GB} GB free under {disk}, which has 0.1 GB: "
                     r"free some, or pass --basetemp on a disk with room", result.stdout)
    assert " passed" not in result.stdout and not (disk / "basetemp").exists()


def test_a_passing_tests_folder_goes_at_its_end_a_failing_ones_stays(tmp_path):
    """pyproject.toml's retention: the suite's checkpoints are gone test by test, not kept for
    three sessions (16 GB), and a failure's files stay to be looked at."""
    (tmp_path / "test_two.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'checkpoint').write_bytes(bytes(10**6))\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'checkpoint').write_bytes(bytes(10**6))\n"
        "    assert False\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-c", REPO / "pyproject.toml",
                             "-p", "no:cacheprovider", "--basetemp", tmp_path / "basetemp",
                             "--rootdir", tmp_path, tmp_path / "test_two.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    folders = [p.name for p in (tmp_path / "basetemp").iterdir() if not p.is_symlink()]
    assert folders == ["test_fails0"], folders


# Probes glibc from inside a worker: an 8 MiB block freed first (glibc's own rule would then raise
# its mmap threshold to 8 MiB), then 64 blocks of 512 KiB made and freed with a small one made
# after them (which holds the heap's end where they are): how much of their 32 MiB the process
# still holds (RssAnon) once they are freed.
MMAP_PROBE = """    def rss_anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))
    freed = torch.ones(2**23, dtype=torch.uint8)
    del freed
    before = rss_anon()
    blocks = [torch.ones(2**19, dtype=torch.uint8) for _ in range(64)]
    holds_the_end = torch.ones(16, dtype=torch.uint8)
    del blocks
    print(f"rank {dist.get_rank()}: kept {(rss_anon() - before) // 1024} MiB of 32", flush=True)
    del holds_the_end
"""


@pytest.mark.parametrize("flags", [["--return-freed-memory"], []])
def test_freed_memory_goes_back_to_the_system_on_cpu(tmp_path, flags):
    """On CPU, with --return-freed-memory, a worker fixes glibc's mmap threshold: after a big
    block was freed, 32 MiB of 512 KiB blocks go back to the system when freed. By default, as
    glibc does, much of them stays with the process, for reuse (benchmarks/README.md measures
    what returning them saves in training, and what it costs)."""
    script = script_with_lines("fsdp2_transformer.py", tmp_path, "def main(args, device):\n",
                               MMAP_PROBE)
    run = run_command(torchrun_command(script, [*FSDP2_TINY, "--steps", 1, *flags], 2), tmp_path,
                      timeout=120)
    assert run.returncode == 0, run.output
    kept = [int(mib) for mib in re.findall(r"rank \d: kept (-?\d+) MiB of 32", run.stdout)]
    assert len(kept) == 2 and (max(kept) < 4 if flags else min(kept) >= 8), run.stdout
