"""--fault-tolerance (torchft) in fsdp2_transformer.py, on CPU, with real processes and real kills:
replica groups that average like HSDP's replicas, a group whose rank is killed restarting by itself
and healing from a live one while the other trains on, a stopped group and a killed Lighthouse
ending in one line, and a checkpoint of a fault-tolerant run resuming without it. Skipped where
torchft is not installed (.ci/run installs it).

The kill test starts the groups as a user does, `python fsdp2_transformer.py --fault-tolerance`
(its Lighthouse and a torchrun job per group, new processes); the others start a torchrun job per
group with a Lighthouse of their own, as a cluster does (slurm_fault_tolerant.sbatch), forked as
run_command's runs are."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from conftest import (
    FSDP2_TINY,
    REPO,
    TORCHRUN,
    TORCHRUN_REPORT,
    run_command,
    single_error_line,
    start_torchrun,
    warning_lines,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

TORCHFT = pytest.importorskip("torchft._torchft",
                              reason="torchft is not installed (pip install torchft==0.2.0)")

SCRIPT = REPO / "fsdp2_transformer.py"
# Long enough that the killed group restarts and heals while the other still trains (about 15 s of
# torchrun, imports and start-up on 2 busy cores).
STEPS = 150
FT = [*FSDP2_TINY, "--log-every", 1, "--dist-timeout", 20, "--fault-tolerance"]
# HSDP on 4 ranks (--replicate-degree 2, 2 ranks sharding each replica), 10 steps: the cached run
# that test_slurm.py's test_srun_on_two_nodes_is_hsdp reads too (the same command line).
HSDP = ["--cpu", *FSDP2_TINY, "--steps", 10, "--replicate-degree", 2]


class Lines:
    """The lines of the replica groups' output as they come, each with the time it came and
    "[group G] " in front: [(seconds, from stderr, line)]."""

    def __init__(self):
        self.lines = []

    def running(self):
        raise NotImplementedError

    def wait_until(self, condition, timeout=180, waiting_for="the condition"):
        """The first value of condition() that is not None, asked every 50 ms while the jobs run,
        for timeout seconds at most."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (value := condition()) is not None:
                return value
            if not self.running():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {waiting_for}:\n{self.output}")

    def wait_for(self, pattern, timeout=180):
        """The time of the first line matching pattern, waiting for it."""
        return self.wait_until(
            lambda: next((at for at, _, line in self.lines if re.search(pattern, line)), None),
            timeout, f"line matches {pattern!r}")

    @property
    def output(self):
        return "\n".join(line for _, _, line in self.lines)

    def steps(self, group):
        """The (time, step) of each step line of a group: with --log-every 1, one per step."""
        return [(at, int(m[1])) for at, _, line in self.lines
                if (m := re.match(rf"\[group {group}\] step (\d+) \|", line))]


class Groups(Lines):
    """`python fsdp2_transformer.py --fault-tolerance ...` (the Lighthouse and a torchrun job per
    replica group) in cwd, its lines read as they come."""

    def __init__(self, cwd, *args):
        super().__init__()
        self.process = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.readers = []
        for stream in (self.process.stdout, self.process.stderr):
            self.readers.append(threading.Thread(target=self.read, args=(stream,)))
            self.readers[-1].start()

    def read(self, stream):
        for line in stream:
            self.lines.append((time.monotonic(), stream is self.process.stderr, line.rstrip()))

    def running(self):
        return self.process.poll() is None

    def workers(self, group):
        """The training processes of a replica group (not its torchrun agent), by local rank."""
        found = [p for p in psutil.Process(self.process.pid).children(recursive=True)
                 if "--replica-group" in p.cmdline() and "torch.distributed.run" not in p.cmdline()
                 and p.cmdline()[p.cmdline().index("--replica-group") + 1] == str(group)]
        return sorted(found, key=lambda p: int(p.environ().get("LOCAL_RANK", 0)))

    def wait(self, timeout=300):
        try:
            self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    child.kill()
                self.process.kill()
            for reader in self.readers:
                reader.join()
        return self.process.returncode


class GroupJobs(Lines):
    """A torchrun job of `ranks` ranks per replica group (0 and 1), each joining the Lighthouse at
    `lighthouse` ($TORCHFT_LIGHTHOUSE), in cwd; forked as run_command's runs are (new processes
    with forks off). Group g writes its metrics to metrics.group<g>.json and its output to
    group<g>.stdout and group<g>.stderr, read as it comes. A context manager: the jobs and their
    workers (stopped ones too) are killed where the test ends before them. Only the test's thread
    asks whether a job has ended (a forked agent's exit status is read once, from a pipe)."""

    def __init__(self, cwd, lighthouse, ranks, *args):
        super().__init__()
        # One thread per worker, as torchrun gives each where it starts several (and as
        # test_slurm.py's job has): a group of one rank with two took 2 s a step on 2 busy cores.
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
        self.jobs, self.readers, self.ended = [], [], threading.Event()
        for group in (0, 1):
            command = [str(c) for c in [
                *TORCHRUN, "--standalone", "--nproc_per_node", ranks, SCRIPT, *args,
                "--replica-group", group, "--metrics-json", cwd / f"metrics.group{group}.json"]]
            outputs = (cwd / f"group{group}.stdout", cwd / f"group{group}.stderr")
            for path in outputs:
                path.touch()
                self.readers.append(threading.Thread(target=self.read, args=(path, group),
                                                     daemon=True))
                self.readers[-1].start()
            self.jobs.append(start_torchrun(command, cwd, env, outputs))

    def read(self, path, group):
        """Each line of the file at path as it is written, until the jobs have ended."""
        with open(path, "rb") as f:
            pending = b""
            while True:
                ended = self.ended.is_set()
                *complete, pending = (pending + f.read()).split(b"\n")
                self.lines.extend((time.monotonic(), path.suffix == ".stderr",
                                   f"[group {group}] {line.decode(errors='replace')}")
                                  for line in complete)
                if ended:
                    return
                time.sleep(0.05)

    def running(self):
        return any(job.poll() is None for job in self.jobs)

    def workers(self, group):
        """pids of a replica group's training processes, by rank."""
        return [pid for _, pid in sorted(self.jobs[group].workers().items())]

    def wait(self, timeout=300):
        """The jobs' exit statuses, once both have ended, and every line they wrote."""
        deadline = time.monotonic() + timeout
        for job in self.jobs:
            job.wait(max(deadline - time.monotonic(), 0.01))
        self.stop_reading()
        return [job.returncode for job in self.jobs]

    def stop_reading(self):
        self.ended.set()
        for reader in self.readers:
            reader.join()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        for job in self.jobs:
            if job.poll() is None:
                for pid in job.workers().values():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                job.kill()
                job.wait()
        self.stop_reading()


@pytest.fixture(scope="module")
def hsdp(cached_torchrun):
    """The training of test 1 as HSDP on 4 ranks: 2 replicas of 2 ranks sharding each."""
    run = cached_torchrun("fsdp2_transformer.py", *HSDP, nproc=4)
    assert run.returncode == 0, run.output
    return run.metrics


@pytest.fixture(scope="module")
def without_fault(tmp_path_factory):
    """The kill test's training without a fault, on one process: --batch-size is global, so every
    layout has the same losses (one process's and HSDP's on 4 ranks, 2 replicas like the groups,
    within 3.2e-7 relative over these 150 steps). One thread, as the groups' workers have (torchrun
    gives each 1 where it starts several): with two, each step took 8 times as long on 2 busy
    cores."""
    cwd = tmp_path_factory.mktemp("without_fault")
    run = run_command([*TORCHRUN, "--standalone", "--nproc_per_node", 1, SCRIPT, *FSDP2_TINY,
                       "--cpu", "--steps", STEPS], cwd, 300, env={"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    return run.metrics


def group_metrics(cwd, group):
    return json.loads((cwd / f"metrics.group{group}.json").read_text())


# torchft's Lighthouse (its Rust server, which torchft_lighthouse runs) in a process of its own,
# loaded from torchft's extension module alone: the package imports torch first (4.5 s of CPU on 2
# busy cores) for a server that needs none of it.
LIGHTHOUSE = """import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("torchft._torchft", sys.argv[1])
torchft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torchft)
server = torchft.LighthouseServer(bind="[::]:0", min_replicas=int(sys.argv[2]),
                                  join_timeout_ms=1000, heartbeat_timeout_ms=1000)
print(server.address(), flush=True)
time.sleep(600)
"""


class Lighthouse:
    """A Lighthouse as slurm_fault_tolerant.sbatch and the script's launcher start theirs: a quorum
    of at least min_replicas groups, without a group that has not asked within 1 s; a group that
    sent no heartbeat for 1 s dropped; only its warnings printed (RUST_LOG). A context manager,
    which kills it (kill() does so before)."""

    def __init__(self, cwd, min_replicas):
        self.process = subprocess.Popen(
            [sys.executable, "-c", LIGHTHOUSE, TORCHFT.__file__, str(min_replicas)], cwd=cwd,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"})
        self.address = self.process.stdout.readline().strip()
        assert self.address.startswith("http://"), self.address

    def kill(self):
        self.process.kill()
        self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.kill()


def test_two_replica_groups_train_the_losses_of_hsdp(tmp_path, hsdp):
    """2 groups of 2 ranks, no fault (a Lighthouse whose every quorum holds both): each group's
    loss is that of its rows (HSDP replica g's); their mean is HSDP's loss, step by step, within
    1e-6, and the gradient norms (of the averaged gradients) are the same in both groups and in
    HSDP."""
    with Lighthouse(tmp_path, min_replicas=2) as server, GroupJobs(
            tmp_path, server.address, 2, *FT, "--steps", 10) as groups:
        assert groups.wait() == [0, 0], groups.output
    first, second = group_metrics(tmp_path, 0), group_metrics(tmp_path, 1)
    assert len(first["losses"]) == len(second["losses"]) == 10
    for step, (a, b, both) in enumerate(zip(first["losses"], second["losses"], hsdp["losses"])):
        assert abs((a + b) / 2 - both) < 1e-6, (step + 1, a, b, both)
    for a, b, both in zip(first["grad_norms"], second["grad_norms"], hsdp["grad_norms"]):
        assert a == b and abs(a - both) < 1e-5
    assert not warning_lines(groups.output) and "Traceback" not in groups.output, groups.output
    assert "[INFO]" not in groups.output, groups.output  # torchft's, which the script quiets


def test_a_killed_group_restarts_heals_and_the_other_trains_on(tmp_path, without_fault):
    """SIGKILL of rank 1 of group 1 at group 0's step 5: group 0 commits every step (each step
    line once, 1 to STEPS: none lost) and goes on within seconds; group 1 restarts (torchrun),
    heals from group 0, and from then on the two groups' parameters are bit-identical (their
    checkpoints of the same steps); the loss of the last 10 steps is within 0.75 of the training's
    without a fault (group 1's rows were skipped from the kill to the heal: about half of the
    steps). Each failure seen is one line."""
    groups = Groups(tmp_path, *FT, "--world-size", 2, "--steps", STEPS, "--checkpoint-dir", "ckpt",
                    "--checkpoint-format", "sharded", "--save-every", 20, "--metrics-json",
                    tmp_path / "metrics.json")
    groups.wait_for(r"\[group 0\] step 5 \|")
    groups.workers(1)[1].kill()
    killed = time.monotonic()
    assert groups.wait() == 0, groups.output
    output = groups.output
    steps = groups.steps(0)
    assert [step for _, step in steps] == list(range(1, STEPS + 1)), output
    after_kill = [at for at, _ in steps if at > killed]
    gaps = [b - a for a, b in zip(after_kill, after_kill[1:])]
    print(f"group 0: its next step {after_kill[0] - killed:.2f} s after the kill; the longest "
          f"gap between its steps after it {max(gaps):.2f} s")
    healed = groups.wait_for(r"\[group 1\] step \d+: healed")
    assert re.search(r"\[group 0\] step \d+: 1 of 2 replica groups train", output), output
    assert re.search(r"\[group 0\] step \d+: all 2 replica groups train again", output), output
    healed_at = int(re.search(r"\[group 1\] step (\d+): healed", output)[1])
    print(f"group 1: healed at step {healed_at} of {STEPS}, {healed - killed:.1f} s after the kill")
    for step in (s for s in [*range(20, STEPS, 20), STEPS] if s > healed_at):
        states = []
        for group in (0, 1):
            dcp_to_torch_save(tmp_path / f"ckpt/group_{group}/step_{step:06d}",
                              tmp_path / f"{group}-{step}.pt")
            states.append(torch.load(tmp_path / f"{group}-{step}.pt", weights_only=True))
        for name, value in states[0]["model"].items():
            assert torch.equal(value, states[1]["model"][name]), (step, name)
    # The loss of the last 10 steps, both groups' rows, against the training's without the fault
    last = [sum(group_metrics(tmp_path, group)["losses"][-10:]) / 10 for group in (0, 1)]
    final, without = sum(last) / 2, sum(without_fault["losses"][-10:]) / 10
    print(f"loss of the last 10 steps {final:.4f}, without the fault {without:.4f}")
    assert abs(final - without) < 0.75  # group 1's rows skipped in about half of the steps
    assert "Traceback" not in output and not warning_lines(output), output
    # Resumed without --fault-tolerance, on 1 rank (the groups had 2): the same model
    resumed = run_command([*TORCHRUN, "--standalone", "--nproc_per_node", 1, SCRIPT, *FSDP2_TINY,
                           "--steps", STEPS + 2, "--checkpoint-dir", "ckpt/group_0",
                           "--checkpoint-format", "sharded"], tmp_path, 120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"group_0/step_{STEPS:06d} at step {STEPS}" in resumed.stdout, resumed.stdout
    assert abs(resumed.metrics["losses"][0] - last[0]) < 0.5


def live_group(groups, step):
    """The group that trains from step 1 without healing, once it has trained to step with the
    other in its quorum (its last line on the groups training says both train); else None. With
    no launcher making the first quorum wait for both groups, either may start first and the
    other heal into the run."""
    for group in (0, 1):
        own = [line for _, _, line in groups.lines if line.startswith(f"[group {group}] ")]
        events = [line for line in own if re.match(
            rf"\[group {group}\] step \d+: (1 of 2|all 2) replica groups train", line)]
        trained = [n for _, n in groups.steps(group)]
        healed = any(": healed" in line for line in own)
        if (trained[:1] == [1] and trained[-1] >= step and not healed
                and (not events or "all 2 replica groups train again" in events[-1])):
            return group
    return None


# The stop comes once both groups train, which may be some steps after one started alone.
STOPPED_STEPS = 60


def test_a_stopped_group_is_left_behind_in_one_line(tmp_path):
    """SIGSTOP of one group (hung, not dead; of one rank: a group of 2 fails its own collectives
    once continued) at the other's step 5 or after, both training: the live group's all-reduce
    fails after --dist-timeout, in one line (where the stop lands between the stopped group's
    steps, none fails: the Lighthouse leaves it out of the next quorum); it then trains on alone,
    saying so (the Lighthouse dropped the stopped group, whose heartbeats stopped), every step
    once; the stopped group, continued 7 steps later, ends well too (its stalled all-reduce fails,
    and it trains on)."""
    with Lighthouse(tmp_path, min_replicas=1) as server, GroupJobs(
            tmp_path, server.address, 1, *FT, "--steps", STOPPED_STEPS,
            "--dist-timeout", 8) as groups:
        live = groups.wait_until(lambda: live_group(groups, 5),
                                 waiting_for="group trained from step 1 to step 5")
        hung = groups.workers(1 - live)[0]
        os.kill(hung, signal.SIGSTOP)
        stopped, at = time.monotonic(), groups.steps(live)[-1][1]
        groups.wait_for(rf"\[group {live}\] step {at + 7} \|", timeout=120)
        os.kill(hung, signal.SIGCONT)
        codes = groups.wait()
    assert codes == [0, 0], groups.output
    after = [line for time_, _, line in groups.lines if time_ > stopped]
    failed = [line for line in after  # rank 0's, at most one
              if "not committed" in line and line.startswith(f"[group {live}]")]
    assert len(failed) <= 1 and all(
        line.startswith(f"[group {live}] replica group {live}: step") for line in failed), (
        groups.output)
    assert any(re.match(rf"\[group {live}\] step \d+: 1 of 2 replica groups train", line)
               for line in after), groups.output
    assert [step for _, step in groups.steps(live)] == list(range(1, STOPPED_STEPS + 1)), (
        groups.output)
    assert "Traceback" not in groups.output, groups.output


def test_a_killed_lighthouse_ends_each_group_in_one_line(tmp_path):
    """The cluster's way: a Lighthouse of its own (a process of its own, killed with SIGKILL) and a
    torchrun job per group. Killed once both groups train (each at step 5 or later), each group
    ends with one error line naming it, within --dist-timeout, not a hang. Either group may start
    first: the other heals into the run and logs its steps from there (once, under load, group 0
    joined after group 1's step 22, and a wait for its step 5 timed out)."""
    with Lighthouse(tmp_path, min_replicas=1) as server, GroupJobs(
            tmp_path, server.address, 1, *FT, "--steps", 1000, "--dist-timeout", 10) as groups:
        groups.wait_until(lambda: all(any(step >= 5 for _, step in groups.steps(group))
                                      for group in (0, 1)) or None,
                          timeout=120, waiting_for="step 5 or later in both groups")
        server.process.send_signal(signal.SIGKILL)
        started = time.monotonic()
        codes = groups.wait(120)
    for group, code in enumerate(codes):
        assert code != 0
        stderr = (tmp_path / f"group{group}.stderr").read_text()
        lines = [line for line in stderr.split(TORCHRUN_REPORT)[0].splitlines()
                 if "error" in line.lower()]  # (torchrun's report follows)
        assert len(lines) == 1 and f"replica group {group}: no quorum from the Lighthouse at " \
            f"{server.address}" in lines[0], stderr
    print(f"both groups ended {time.monotonic() - started:.1f} s after the Lighthouse was killed")


@pytest.mark.parametrize("flags, env, line", [
    (["--replica-group", 0], {}, "--replica-group names a replica group of --fault-tolerance"),
    (["--fault-tolerance", "--replica-group", 0], {},
     "start one (torchft_lighthouse --min_replicas 1) and set TORCHFT_LIGHTHOUSE"),
    (["--fault-tolerance", "--replica-group", 0, "--pack-documents"], {},
     "--pack-documents with --fault-tolerance is not supported here"),
    (["--fault-tolerance"], {"PYTHONPATH": "no_torchft"}, "pip install torchft==0.2.0"),
], ids=["group without the flag", "no Lighthouse", "packed documents", "torchft missing"])
def test_fault_tolerance_flags_that_cannot_work_end_in_one_line(tmp_path, flags, env, line):
    """Checked before any process group, under torchrun (one replica group's job)."""
    (tmp_path / "no_torchft" / "torchft").mkdir(parents=True)  # an import of torchft fails
    (tmp_path / "no_torchft" / "torchft" / "__init__.py").write_text(
        "raise ImportError('No module named torchft')\n")
    env = {key: str(tmp_path / value) for key, value in env.items()}
    run = run_command([*TORCHRUN, "--standalone", "--nproc_per_node", 1, SCRIPT, *FSDP2_TINY,
                       *flags], tmp_path, 120, env=env)
    assert run.returncode != 0
    assert line in single_error_line(run)
