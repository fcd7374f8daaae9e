"""Shared fixtures: offline datasets and a helper that runs a script under torch.distributed.run."""
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pytest
import torch
from digits_mnist import write_digits_mnist
from forked_torchrun import (
    IDLE_VARIABLE,
    SWITCH,
    ForkedAgent,
    NewAgent,
    autogroups,
    cuda_devices,
    forked_python,
    forked_torchrun,
    forks,
    torchrun_hook_as_expected,
)
from tiny_wikihow import write_tiny_t5, write_wikihow

REPO = Path(__file__).resolve().parent.parent
# where torchrun's failure report starts
TORCHRUN_REPORT = "torch/distributed/elastic/multiprocessing/api.py"

# downloads fail at once (every run's environment; HF_HUB_OFFLINE=0 tries to download)
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}

# The tiny configurations the test files share: the same command line is one cached run
# (cached_torchrun).
MNIST_TINY = ["--batch-size", "32", "--test-batch-size", "100"]
FSDP2_TINY = ["--vocab-size", 64, "--dim", 32, "--n-layers", 3, "--seq-len", 16, "--batch-size", 8,
              "--log-every", 5]
# FSDP2's reference run: 20 steps on 2 ranks, checkpoints at steps 10 and 20 in its own folder.
FSDP2_REFERENCE = [*FSDP2_TINY, "--steps", 20, "--checkpoint-dir", "ckpt", "--save-every", 10]
# The same with sharded checkpoints written in the background, on a wider model (dim 128): DCP's
# few KiB per tensor would otherwise hide that each rank writes half the state.
FSDP2_SHARDED = [*FSDP2_TINY, "--dim", 128, "--steps", 20, "--checkpoint-dir", "ckpt",
                 "--save-every", 10, "--checkpoint-format", "sharded", "--async-checkpoint"]
# 31: DistributedSampler repeats one example. 64 training articles: 8 steps an epoch on 2 ranks,
# most of a T5 run's time (the validation loss still falls every epoch of 3 at --lr 0.01).
T5_INPUT_LENGTH, T5_OUTPUT_LENGTH, T5_VAL_SAMPLES = 64, 24, 31
T5_TINY = ["--input-length", T5_INPUT_LENGTH, "--output-length", T5_OUTPUT_LENGTH,
           "--num-train-samples", 64, "--num-val-samples", T5_VAL_SAMPLES, "--lr", 0.01]
# 3 epochs, default FULL_SHARD, BACKWARD_PRE, auto precision; --rouge: each epoch's summaries
# generated (gathered once) and scored (tests/test_generation.py, check_export in test_t5.py).
# T5_SHARDED: the runs that resume from the reference's checkpoints or compare its losses only
# (generating costs a run 3-4 s, and its losses do not change).
T5_SHARDED = ["--checkpoint-type", "sharded"]
T5_REFERENCE = [*T5_SHARDED, "--rouge"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "smoke(*scripts): the two-minute tier (python -m pytest -m "
                            "smoke): for each script named, what matters most")


SMOKE = pytest.mark.smoke  # SMOKE("fsdp2_transformer.py"): a test of the smoke tier


# The most the suite holds on disk at once, measured over a whole run (`df` every second): 1.9 GB,
# the three 640 MB checkpoints of test_fsdp2_scale's async-save test. Passing tests' folders go at
# their end (pyproject.toml); with less room tests would fail here and there with ENOSPC.
DISK_NEEDED_GB = 3


def pytest_sessionstart(session):
    """Stop at once, in one line, where the temporary folder's disk has too little room."""
    folder = Path(session.config.option.basetemp or tempfile.gettempdir()).resolve()
    while not folder.exists():  # --basetemp may name a folder still to be made
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 1e9
    if free < DISK_NEEDED_GB:
        pytest.exit(f"the tests need {DISK_NEEDED_GB} GB free under {folder}, which has "
                    f"{free:.1f} GB: free some, or pass --basetemp on a disk with room",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_finish(session):
    """With SMOKE_SCRIPTS_FILE set, write the scripts the collected smoke tests name (for
    test_layout.py's check that the tier covers all four)."""
    if os.environ.get("SMOKE_SCRIPTS_FILE"):
        scripts = {script for item in session.items for mark in item.iter_markers("smoke")
                   for script in mark.args}
        Path(os.environ["SMOKE_SCRIPTS_FILE"]).write_text(json.dumps(sorted(scripts)))


def pytest_collection_modifyitems(config, items):
    # The test files with a start_early(request) (see start_early below) run last.
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "start_early"))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def offline_hf(tmp_path_factory):
    """No hub access, downloads that fail at once, and this session's own datasets cache (here and
    in every script run); every process the tests start imports tests/startup/sitecustomize.py."""
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                            *NO_NETWORK.items(), ("HF_DATASETS_CACHE", str(cache)),
                            ("PYTHONPATH", os.pathsep.join(filter(None, [
                                str(REPO / "tests" / "startup"), os.environ.get("PYTHONPATH")])))):
            patch.setenv(name, value)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        yield


@pytest.fixture(scope="session", autouse=True)
def start_early(request, offline_hf):
    """As the session starts, call start_early(request) of each test file that has one: it starts
    its runs in the background, and its tests, which run last, wait for them. Those runs fill the
    cores that the other tests leave idle for part of their time."""
    for module in dict.fromkeys(item.module for item in request.session.items):
        if hasattr(module, "start_early"):
            module.start_early(request)


class Idle:
    """A command started at the lowest CPU priority, in its own session, output to files in cwd:
    it runs on the cores the other tests leave idle (26% of the 2 cores' time during the suite,
    from /proc/stat over a CI run) and hardly slows the tests beside it. wait() gives (return
    code, stdout, stderr); a run still going as the session ends (request's) is killed with all it
    started. The priority: nice 19 (through the nice command, not Popen's preexec_fn, which may
    deadlock in a process with threads), and, where Linux groups each session's processes for
    scheduling (autogroup), the group's nice 19 too (lower_idle_autogroups). A torchrun_command
    is forked as run_command's are (its agent and workers lower their own priority: IDLE_VARIABLE
    in forked_torchrun), where a new process would import torch and the script's modules again
    (over a CI run: 5-6 s of CPU for each worker of fsdp2_transformer.py, 3-4 s for torchrun)."""

    def __init__(self, request, command, cwd, env=None):
        self.cwd = Path(cwd)
        env = {**(env or os.environ), IDLE_VARIABLE: "1"}
        command = [str(c) for c in command]
        outputs = (self.cwd / "idle.stdout", self.cwd / "idle.stderr")
        if forks(env) and (arguments := torchrun_arguments(command)) is not None:
            self.proc = ForkedAgent(arguments, cwd, env, outputs, new_session=True)
        else:
            with open(outputs[0], "w") as out, open(outputs[1], "w") as err:
                self.proc = subprocess.Popen(["nice", "-n", "19", *command], cwd=cwd, env=env,
                                             stdout=out, stderr=err, start_new_session=True)
        if request:  # else the caller kills it (IdleQueue)
            request.addfinalizer(self.kill)
        start_lowering_idle_autogroups()

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return (self.proc.returncode, (self.cwd / "idle.stdout").read_text(),
                (self.cwd / "idle.stderr").read_text())

    def kill(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def lower_idle_autogroups():
    """Every second, give nice 19 to the scheduling group of each session an Idle's processes
    run in. With autogroup (Linux's default on desktops and on CI here), a process's nice counts
    only within its session's group, and the groups share the CPU fairly: torchrun starts each
    worker in a session of its own, so an Idle's workers, though at nice 19, took as much as
    the tests' (55% of the CPU in the suite's first minutes, the idle time that came later left
    unused). A group's nice is set by writing to /proc/PID/autogroup."""
    mark = f"{IDLE_VARIABLE}=1".encode()
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    group = Path(f"/proc/{pid}/autogroup")
                    if not group.read_text().rstrip().endswith(" nice 19"):
                        group.write_text("19")
        time.sleep(1)


@functools.cache
def start_lowering_idle_autogroups():
    if autogroups():
        threading.Thread(target=lower_idle_autogroups, daemon=True).start()


class IdleQueue:
    """Commands run one after another, each an Idle, from a thread of their own: run(command, cwd,
    timeout) gives a future of its Run. One at a time, not all at once: a T5 run holds 1-2 GB, and
    the idle time they fill comes a little at a time. The session's end stops the queue and kills
    the command running."""

    def __init__(self, request):
        self.pool, self.lock = ThreadPoolExecutor(max_workers=1), threading.Lock()
        self.current, self.stopped = None, False
        request.addfinalizer(self.stop)

    def run(self, command, cwd, timeout):
        return self.pool.submit(self._run, command, cwd, timeout)

    def _run(self, command, cwd, timeout):
        with self.lock:
            if self.stopped:
                raise RuntimeError("the session ended before this command started")
            self.current = Idle(None, command, cwd)
        returncode, stdout, stderr = self.current.wait(timeout)
        return Run(returncode, stdout, stderr, metrics_in(cwd), Path(cwd))

    def stop(self):
        with self.lock:
            self.stopped = True
            if self.current:
                self.current.kill()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """A --data-dir whose MNIST/raw holds IDX files made from scikit-learn's bundled digits."""
    return write_digits_mnist(tmp_path_factory.mktemp("mnist_data"))


@pytest.fixture(scope="session")
def wikihow_dir(tmp_path_factory):
    """A --data-dir with a WikiHow-format wikihowAll.csv and the official split lists
    (tests/tiny_wikihow.py)."""
    return write_wikihow(tmp_path_factory.mktemp("wikihow_data"))


@pytest.fixture(scope="session")
def tiny_t5_dir(tmp_path_factory):
    """A --model-name directory: a tiny random T5 and a tokenizer trained on the WikiHow fixture."""
    return write_tiny_t5(tmp_path_factory.mktemp("tiny_t5"))


@pytest.fixture(scope="session")
def still_t5_dir(tmp_path_factory):
    """The tiny T5 without dropout: runs at different world sizes draw no random masks, so the
    same global batch gives the same losses."""
    return write_tiny_t5(tmp_path_factory.mktemp("still_t5"), dropout_rate=0.0)


@pytest.fixture(scope="session")
def untied_t5_dir(tmp_path_factory):
    """The tiny T5 with an lm_head of its own (T5 v1.1 and flan-t5 style), not tied to the
    embedding."""
    return write_tiny_t5(tmp_path_factory.mktemp("untied_t5"), untied=True)


@pytest.fixture(scope="session")
def wide_t5_dir(tmp_path_factory):
    """The same, 322 MB of weights (d_model 1024, 4 layers): big enough to see loading in RSS."""
    return write_tiny_t5(tmp_path_factory.mktemp("wide_t5"), d_model=1024, num_layers=4)


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    metrics: dict | None
    cwd: Path

    @property
    def output(self):
        return self.stdout + self.stderr

    @property
    def worker_stderr(self):
        """Workers' stderr, without the report torchrun adds (with its own traceback) on failure."""
        return self.stderr.split(TORCHRUN_REPORT)[0]


def warning_lines(output):
    """The lines of a run's output that speak of a Python warning or of leaks reported at exit
    (multiprocessing's resource tracker, nanobind's as in triton >= 3.9): default commands print
    none."""
    return [line for line in output.splitlines()
            if "Warning" in line or "leaked" in line or "nanobind" in line]


def single_error_line(run):
    """The `error:` line of a failed run, asserting that it is the only line of the workers that
    speaks of an error (rank 0's, no library log repeating it) and that there is no worker
    traceback."""
    # torchrun's own log lines (torch/distributed/elastic) do not count
    lines = [line for line in run.worker_stderr.splitlines()
             if "error" in line.lower() and "torch/distributed/elastic" not in line]
    assert (len(lines) == 1 and "error:" in lines[0]
            and "Traceback" not in run.worker_stderr), run.worker_stderr
    return lines[0]


def run_command(command, cwd, timeout, env=None):
    """Run a command in cwd with a timeout; return a Run, with its metrics JSON if written."""
    metrics_path = Path(cwd) / "metrics.json"
    command = [str(c) for c in command]
    if "--metrics-json" not in command:
        command += ["--metrics-json", str(metrics_path)]
    metrics_path.unlink(missing_ok=True)  # never read an earlier run's metrics
    env = {**os.environ, **(env or {})}
    fork = forks(env)  # else every process is a new one, as torchrun and python start them
    if fork and (arguments := torchrun_arguments(command)) is not None:
        returncode, stdout, stderr = forked_torchrun(arguments, cwd, timeout, env)
    elif fork and command[0] == sys.executable and command[1].endswith(".py") and (
            forked := forked_python(command[1:], cwd, timeout, env)):
        returncode, stdout, stderr = forked
    else:
        proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=env)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    return Run(returncode, stdout, stderr, metrics_in(cwd), Path(cwd))


def start_torchrun(command, cwd, env, outputs, new_session=False):
    """Start a torchrun_command in the background (what a test stops, kills or waits for: pid,
    poll, wait, kill, workers()), forked as run_command's are (as new processes when forks are
    off), writing to the files at outputs (stdout, stderr: one path twice, one file, as a batch
    job's `> log 2>&1`)."""
    command = [str(c) for c in command]
    if forks(env):
        return ForkedAgent(torchrun_arguments(command), cwd, env, outputs, new_session=new_session)
    return NewAgent(command, cwd, env, outputs, new_session=new_session)


def metrics_in(cwd):
    """The metrics JSON a run wrote into cwd (--metrics-json cwd/metrics.json), or None."""
    path = Path(cwd) / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def pytest_terminal_summary(terminalreporter):
    """The one sign that forks() fell back to new processes by itself (no warning: the tests
    assert that runs print none)."""
    if os.environ.get(SWITCH) == "0":
        return
    if cuda_devices():
        terminalreporter.write_line("Every run was a new process: this machine has a CUDA device, "
                                    "which a process forked after CUDA's start cannot use")
    elif not torchrun_hook_as_expected():
        terminalreporter.write_line("Every run was a new process: torchrun's SubprocessHandler is "
                                    "not what tests/forked_torchrun.py expects (tests/README.md)")


# `python -m torch.distributed.run`, with one difference that only makes it exit sooner: it freezes
# its objects at exit, so that Python's last garbage collection does not walk every object torch
# made: 0.4-0.5 s less per launch, about a minute over the suite. (The scripts do not: a frozen
# object is never freed, which triton >= 3.9, imported by torch's optimizers, reports as a leak.)
TORCHRUN = [sys.executable, "-c", "import atexit, gc, runpy, sys; atexit.register(gc.freeze); "
            "sys.argv[0] = 'torchrun'; "
            "runpy.run_module('torch.distributed.run', run_name='__main__')"]


def torchrun_arguments(command):
    """torchrun's arguments if command (strings) is a torchrun_command, else None."""
    if command[:len(TORCHRUN)] == [str(c) for c in TORCHRUN]:
        return command[len(TORCHRUN):]
    return None


def plan_of(script, cwd, *args):
    """script --plan with these flags, run as a user would: its plan (and the printed table)."""
    result = run_command([sys.executable, REPO / script, "--plan", *args], cwd, timeout=120)
    assert result.returncode == 0 and "predicted peak" in result.stdout, result.output
    return {**result.metrics["plan"], "printed": result.stdout}


def distributed_program(text, **values):
    """A test's own program for torchrun (text, formatted with repo= and values), ending as the
    scripts' plumbing ends a run: its FSDP modules freed (their reference cycles keep the process
    group alive), then the process group destroyed. Then the program leaves without Python's
    teardown. Workaround: once a functional collective (FSDP2's, DTensor's) has used a gloo
    group, destroying it leaves its two worker threads running (torch 2.14 and 2.15: something
    outside Python's objects keeps it; after dist.all_reduce alone they end). Such a thread lets
    go of a collective's tensors just after the caller's wait returns; in a program that ends
    right after its last collective, that can come during the teardown, which it aborts with
    SIGABRT ("terminate called without an active exception": rank 1 of
    test_gradient_accumulation_reduces_once_per_step in CI, once in some 20 suite runs). The
    scripts do more work after their last collective. Remove it when a torch release's
    destroy_process_group ends those threads (pt_gloo_runloop in /proc/self/task)."""
    ending = ("\nimport gc, os, sys\ngc.collect()\ndist.destroy_process_group()\n"
              "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
    return text.format(repo=str(REPO), **values) + ending


def script_with_lines(script, folder, after, lines):
    """A copy of the script in folder, beside a copy of the safeguards package it imports, with
    `lines` added after the line `after`: in the script where it has that line, else in the first
    module of the package that has it. How a test puts a bug or a fault inside a real run. Returns
    the script's copy's path."""
    shutil.copytree(REPO / "safeguards", folder / "safeguards",
                    ignore=shutil.ignore_patterns("__pycache__"))
    files = [folder / script, *sorted((folder / "safeguards").glob("*.py"))]
    (folder / script).write_text((REPO / script).read_text())
    patched = next((path for path in files if after in path.read_text()), None)
    assert patched, f"neither {script} nor the safeguards package has the line {after!r} any more"
    patched.write_text(patched.read_text().replace(after, after + lines, 1))
    return folder / script


def processes_left(cwd, grace=5):
    """The command lines of the processes still running with cwd as their working directory
    (workers left behind), after up to `grace` seconds for those already on their way out (the
    resource tracker of multiprocessing ends a moment after the launcher it served)."""
    deadline = time.monotonic() + grace
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                    left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def checkpoint_writers(worker_pids):
    """The pids of DCP's checkpoint writer processes: spawned children of the workers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if parent in worker_pids and spawned:
            found.append(int(pid))
    return found


def free_ports(count):
    """count distinct free ports of this machine (held together while they are found)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def torchrun_command(script, args, nproc, max_restarts=0):
    return [*TORCHRUN, "--standalone", "--nproc_per_node", nproc, "--max-restarts", max_restarts,
            REPO / script, *args]


@pytest.fixture
def torchrun(tmp_path):
    """torchrun(script, *args, nproc=2, timeout=300, env=None) -> Run, in a fresh tmp_path."""

    def run(script, *args, nproc=2, timeout=300, env=None):
        return run_command(torchrun_command(script, args, nproc), tmp_path, timeout, env)

    return run


@pytest.fixture(scope="session")
def cached_torchrun(tmp_path_factory):
    """Like torchrun, but one run per distinct command line for the whole session.

    Several tests read the same training run (accuracy, parity, memory, saved model); this keeps
    each test self-contained without paying for the same run twice. A run queued by
    queue_cached_run is waited for.
    """
    cache = {}

    def run(script, *args, nproc=2, timeout=300):
        key = cached_key(script, args, nproc)
        if key not in cache and key in EARLY_RUNS:
            cache[key] = EARLY_RUNS[key].result(timeout=1800)
        elif key not in cache:
            cwd = tmp_path_factory.mktemp(Path(script).stem)
            cache[key] = run_command(torchrun_command(script, args, nproc), cwd, timeout)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def idle_queue(request):
    """The session's IdleQueue, for start_early's commands: one queue, in the order queued."""
    return IdleQueue(request)


EARLY_RUNS = {}  # cached_torchrun's key: the future of the Run that queue_cached_run queued


def cached_key(script, args, nproc):
    """The key of a run in cached_torchrun's cache and in EARLY_RUNS."""
    return script, tuple(map(str, args)), nproc


def queue_cached_run(request, script, *args, nproc=2):
    """From a start_early: queue the run that cached_torchrun(script, *args, nproc=nproc) gives,
    in the background at the lowest priority (idle_queue)."""
    key = cached_key(script, args, nproc)
    if key not in EARLY_RUNS:
        cwd = request.getfixturevalue("tmp_path_factory").mktemp(Path(script).stem)
        command = [*torchrun_command(script, args, nproc), "--metrics-json", cwd / "metrics.json"]
        EARLY_RUNS[key] = request.getfixturevalue("idle_queue").run(command, cwd, timeout=900)


def validation_loss(model, dataset):
    """The loss the scripts log for a summarization_dataset split, here in plain Python: the mean
    over articles of each one's mean token loss (in fp32), with model in eval mode."""
    with torch.no_grad():
        logits = model.eval()(input_ids=dataset.source_ids, attention_mask=dataset.source_mask,
                              labels=dataset.target_ids).logits
    token_losses = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2),
                                                     dataset.target_ids, reduction="none")
    return (token_losses.sum(1) / dataset.target_mask.sum(1)).mean().item()


def greedy_summaries(model, tokenizer, dataset, max_new_tokens):
    """Every article's summary in a summarization_dataset split, greedy, in batches of 4: as a
    run on the tests' T5 settings generates them (--test-batch-size 4), here in plain Python."""
    texts = []
    with torch.no_grad():
        for i in range(0, len(dataset), 4):
            ids = model.generate(input_ids=dataset.source_ids[i:i + 4],
                                 attention_mask=dataset.source_mask[i:i + 4],
                                 max_new_tokens=max_new_tokens)
            texts += tokenizer.batch_decode(ids, skip_special_tokens=True)
    return texts


def t5_args(model_dir, data_dir, epochs, *args):
    return ["--model-name", model_dir, "--data-dir", data_dir, "--epochs", epochs, *T5_TINY, *args]


@pytest.fixture(scope="session")
def help_text(tmp_path_factory):
    """help_text(script): its --help, with argparse's line wrapping undone. The first call runs
    all four scripts' --help side by side."""
    texts = {}

    def text(script):
        if not texts:
            names = ("fsdp1_mnist.py", "ddp_mnist.py", "fsdp2_transformer.py",
                     "t5_fsdp_finetune.py")
            with ThreadPoolExecutor(max_workers=len(names)) as pool:
                runs = pool.map(lambda name: run_command([sys.executable, REPO / name, "--help"],
                                                         tmp_path_factory.mktemp("help"), 60),
                                names)
            for name, run in zip(names, runs):
                assert run.returncode == 0, run.stderr
                texts[name] = " ".join(run.stdout.split())
        return texts[script]

    return text


@pytest.fixture(scope="session")
def fsdp2_reference(cached_torchrun):
    """fsdp2_transformer.py's reference run (FSDP2_REFERENCE), which several test files read."""
    result = cached_torchrun("fsdp2_transformer.py", *FSDP2_REFERENCE)
    assert result.returncode == 0, result.output
    return result


@pytest.fixture(scope="session")
def fsdp2_sharded_reference(cached_torchrun):
    """fsdp2_transformer.py with sharded, asynchronous checkpoints (FSDP2_SHARDED)."""
    result = cached_torchrun("fsdp2_transformer.py", *FSDP2_SHARDED)
    assert result.returncode == 0, result.output
    return result


def full_state_of(checkpoint):
    """{name: tensor} of a checkpoint folder, whichever format: model.pt and optimizer.pt's
    tensors (keys "model.<name>", "optimizer.state.<name>.<key>") or a DCP folder's (FSDP2's
    sharded step_N, T5's checkpoint-epoch-N)."""
    if (checkpoint / ".metadata").exists():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as folder:  # not beside it: tests list folders
            converted = Path(folder) / "state.pt"
            dcp_to_torch_save(checkpoint, converted)
            state = torch.load(converted, weights_only=False)
    else:
        state = {"model": torch.load(checkpoint / "model.pt", weights_only=True),
                 "optimizer": torch.load(checkpoint / "optimizer.pt", weights_only=True)}
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for name, entries in state["optimizer"]["state"].items():
        flat.update({f"optimizer.state.{name}.{k}": v for k, v in entries.items()})
    return flat


@pytest.fixture(scope="session")
def t5_reference(cached_torchrun, tiny_t5_dir, wikihow_dir):
    """t5_fsdp_finetune.py's reference run: 3 epochs with sharded checkpoints, which several test
    files read."""
    result = cached_torchrun("t5_fsdp_finetune.py",
                             *t5_args(tiny_t5_dir, wikihow_dir, 3, *T5_REFERENCE))
    assert result.returncode == 0, result.output
    return result


# LoRA (tests/test_lora.py, test_bad_input.py): adapters of rank 8 on q and v, without dropout, on
# the dropout-free tiny T5 in a global batch of 8 (per rank: 8 / ranks), 2 epochs at --lr 0.002: the
# same losses at any world size.
LORA = ["--lora-rank", 8, "--lora-dropout", 0]


def cached_t5_runs(cached_torchrun, args_of):
    """run(ranks, *args): the cached run of t5_fsdp_finetune.py with args_of(ranks, *args) on
    `ranks` ranks, which must succeed."""

    def run(ranks, *args):
        result = cached_torchrun("t5_fsdp_finetune.py", *args_of(ranks, *args), nproc=ranks)
        assert result.returncode == 0, result.output
        return result

    return run


def lora_args(still_t5_dir, wikihow_dir, ranks, *args):
    return [*t5_args(still_t5_dir, wikihow_dir, 2), "--lr", 0.002, "--batch-size", 8 // ranks,
            *LORA, *args]


@pytest.fixture(scope="session")
def lora_reference(cached_torchrun, still_t5_dir, wikihow_dir):
    """LoRA's reference run: FSDP2 on 2 ranks, with sharded checkpoints and its exports, and its
    summaries generated and scored (--rouge)."""
    result = cached_torchrun("t5_fsdp_finetune.py", *lora_args(
        still_t5_dir, wikihow_dir, 2, "--fsdp-version", 2, "--checkpoint-type", "sharded",
        "--rouge"))
    assert result.returncode == 0, result.output
    return result


def copy_fsdp2_checkpoint(reference, step, dest):
    """A --checkpoint-dir at dest holding `step`'s checkpoint of an fsdp2_transformer.py run."""
    shutil.copytree(reference.cwd / "ckpt" / f"step_{step:06d}", dest / f"step_{step:06d}")
    return dest
