"""--fault-tolerance (torchft) in fsdp2_transformer.py, on CPU, with real processes and real kills:
replica groups that average like HSDP's replicas, a group whose rank is killed restarting by itself
and healing from a live one while the other trains on, a stopped group and a killed Lighthouse
ending in one line, and a checkpoint of a fault-tolerant run resuming without it. Skipped where
torchft is not installed (.ci/run installs it)."""
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
    warning_lines,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")

SCRIPT = REPO / "fsdp2_transformer.py"
# Long enough that the killed group restarts and heals while the other still trains (about 15 s of
# torchrun, imports and start-up on 2 busy cores).
STEPS = 150
FT = [*FSDP2_TINY, "--log-every", 1, "--dist-timeout", 20, "--fault-tolerance"]


class Groups:
    """`python fsdp2_transformer.py --fault-tolerance ...` (the Lighthouse and a torchrun job per
    replica group) in cwd, its lines read as they come, each with the time it came."""

    def __init__(self, cwd, *args):
        self.process = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, self.readers = [], []  # (seconds, stream, line)
        for stream in (self.process.stdout, self.process.stderr):
            self.readers.append(threading.Thread(target=self.read, args=(stream,)))
            self.readers[-1].start()

    def read(self, stream):
        for line in stream:
            self.lines.append((time.monotonic(), stream is self.process.stderr, line.rstrip()))

    def wait_for(self, pattern, timeout=180):
        """The time of the first line matching pattern, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [at for at, _, line in self.lines if re.search(pattern, line)]
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matches {pattern!r}:\n{self.output}")

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

    @property
    def output(self):
        return "\n".join(line for _, _, line in self.lines)

    def steps(self, group):
        """The (time, step) of each step line of a group: with --log-every 1, one per step."""
        return [(at, int(m[1])) for at, _, line in self.lines
                if (m := re.match(rf"\[group {group}\] step (\d+) \|", line))]


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """The same training as HSDP on 4 ranks: --replicate-degree 2, 2 ranks sharding each replica."""
    cwd = tmp_path_factory.mktemp("hsdp")
    run = run_command([*TORCHRUN, "--standalone", "--nproc_per_node", 4, SCRIPT, *FSDP2_TINY,
                       "--log-every", 1, "--steps", STEPS, "--replicate-degree", 2], cwd, 300)
    assert run.returncode == 0, run.stderr
    return run.metrics


def group_metrics(cwd, group):
    return json.loads((cwd / f"metrics.group{group}.json").read_text())


def test_two_replica_groups_train_the_losses_of_hsdp(tmp_path, hsdp):
    """2 groups of 2 ranks, no fault: each group's loss is that of its rows (HSDP replica g's);
    their mean is HSDP's loss, step by step, within 1e-6, and the gradient norms (of the averaged
    gradients) are the same in both groups and in HSDP."""
    groups = Groups(tmp_path, *FT, "--world-size", 2, "--steps", 10, "--metrics-json",
                    tmp_path / "metrics.json", "--min-replicas", 2)
    assert groups.wait() == 0, groups.output
    first, second = group_metrics(tmp_path, 0), group_metrics(tmp_path, 1)
    assert len(first["losses"]) == len(second["losses"]) == 10
    for step, (a, b, both) in enumerate(zip(first["losses"], second["losses"], hsdp["losses"])):
        assert abs((a + b) / 2 - both) < 1e-6, (step + 1, a, b, both)
    for a, b, both in zip(first["grad_norms"], second["grad_norms"], hsdp["grad_norms"]):
        assert a == b and abs(a - both) < 1e-5
    assert not warning_lines(groups.output) and "Traceback" not in groups.output, groups.output


def test_a_killed_group_restarts_heals_and_the_other_trains_on(tmp_path, hsdp):
    """SIGKILL of rank 1 of group 1 at group 0's step 5: group 0 commits every step (each step
    line once, 1 to STEPS: none lost) and goes on within seconds; group 1 restarts (torchrun),
    heals from group 0, and from then on the two groups' parameters are bit-identical (their
    checkpoints of the same steps); the loss of the last 10 steps is within 0.75 of HSDP's
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
    print(f"group 1: healed {healed - killed:.1f} s after the kill")
    assert re.search(r"\[group 0\] step \d+: 1 of 2 replica groups train", output), output
    assert re.search(r"\[group 0\] step \d+: all 2 replica groups train again", output), output
    healed_at = int(re.search(r"\[group 1\] step (\d+): healed", output)[1])
    for step in (s for s in [*range(20, STEPS, 20), STEPS] if s > healed_at):
        states = []
        for group in (0, 1):
            dcp_to_torch_save(tmp_path / f"ckpt/group_{group}/step_{step:06d}",
                              tmp_path / f"{group}-{step}.pt")
            states.append(torch.load(tmp_path / f"{group}-{step}.pt", weights_only=True))
        for name, value in states[0]["model"].items():
            assert torch.equal(value, states[1]["model"][name]), (step, name)
    # The loss of the last 10 steps, both groups' rows, against HSDP's without the fault
    last = [sum(group_metrics(tmp_path, group)["losses"][-10:]) / 10 for group in (0, 1)]
    final, without = sum(last) / 2, sum(hsdp["losses"][-10:]) / 10
    print(f"loss of the last 10 steps {final:.4f}, without the fault (HSDP) {without:.4f}")
    assert abs(final - without) < 0.75  # group 1's rows skipped in about half of the steps
    assert "Traceback" not in output and not warning_lines(output), output
    # Resumed without --fault-tolerance, on 1 rank (the groups had 2): the same model
    resumed = run_command([*TORCHRUN, "--standalone", "--nproc_per_node", 1, SCRIPT, *FSDP2_TINY,
                           "--steps", STEPS + 2, "--checkpoint-dir", "ckpt/group_0",
                           "--checkpoint-format", "sharded"], tmp_path, 120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"group_0/step_{STEPS:06d} at step {STEPS}" in resumed.stdout, resumed.stdout
    assert abs(resumed.metrics["losses"][0] - last[0]) < 0.5


def test_a_stopped_group_is_left_behind_in_one_line(tmp_path):
    """SIGSTOP of group 1 (hung, not dead) at group 0's step 5: group 0's all-reduce fails after
    --dist-timeout, in one line (where the stop lands between group 1's steps, none fails: the
    Lighthouse leaves group 1 out of group 0's next quorum); it then trains on alone, saying so
    (the Lighthouse dropped group 1, whose heartbeats stopped), and group 1, continued later,
    comes back."""
    groups = Groups(tmp_path, *FT, "--world-size", 1, "--steps", 40, "--dist-timeout", 8)
    groups.wait_for(r"\[group 0\] step 5 \|")
    hung = groups.workers(1)[0]
    hung.suspend()
    groups.wait_for(r"\[group 0\] step 12 \|", timeout=120)
    hung.resume()
    assert groups.wait() == 0, groups.output
    failed = [line for _, _, line in groups.lines
              if "not committed" in line and line.startswith("[group 0]")]  # rank 0's, at most one
    assert len(failed) <= 1 and all(
        line.startswith("[group 0] replica group 0: step") for line in failed), groups.output
    assert re.search(r"\[group 0\] step \d+: 1 of 2 replica groups train", groups.output), (
        groups.output)
    assert [step for _, step in groups.steps(0)] == list(range(1, 41)), groups.output
    assert "Traceback" not in groups.output, groups.output


def test_a_killed_lighthouse_ends_each_group_in_one_line(tmp_path):
    """The cluster's way: a Lighthouse of its own (torchft_lighthouse) and a torchrun job per
    group. Killed at step 5, each group ends with one error line naming it, within
    --dist-timeout, not a hang."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; from torchft.coordination import LighthouseServer; "
         "s = LighthouseServer(bind='[::]:0', min_replicas=1, heartbeat_timeout_ms=1000); "
         "print(s.address(), flush=True); time.sleep(600)"],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    address = server.stdout.readline().strip()
    runs = [subprocess.Popen([str(c) for c in [*TORCHRUN, "--standalone", "--nproc_per_node", 1,
                              SCRIPT, *FT, "--steps", 1000, "--dist-timeout", 10,
                              "--replica-group", group]],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "TORCHFT_LIGHTHOUSE": address})
            for group in (0, 1)]
    deadline = time.monotonic() + 120
    seen = ""
    while "step 5 |" not in seen and time.monotonic() < deadline:
        seen += runs[0].stdout.readline()
    server.send_signal(signal.SIGKILL)
    started = time.monotonic()
    for group, run in enumerate(runs):
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode != 0
        lines = [line for line in stderr.split(TORCHRUN_REPORT)[0].splitlines()
                 if "error" in line.lower()]  # (torchrun's report follows)
        assert len(lines) == 1 and f"replica group {group}: no quorum from the Lighthouse at " \
            f"{address}" in lines[0], stderr
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
