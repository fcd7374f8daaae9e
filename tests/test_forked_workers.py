"""The suite's own machinery: a worker forked from a server (forked_torchrun.py) sees what a new
Python process sees, under torchrun and under plain python, and ends the same way; with forks
switched off (FSDP_TESTS_FORK=0), torchrun's hook changed, or a CUDA device present, every run is
a new process."""
import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import forked_torchrun
import pytest
from conftest import FSDP2_TINY, Idle, run_command, script_with_lines, torchrun_command
from forked_torchrun import SWITCH, autogroups, forks, hook_as_expected

# Put after the script's imports: what the script sees of its process, then exit status 3 once
# every rank has written its facts (torchrun stops the other workers when one exits non-zero: a
# rank still importing would never write them).
FACTS = """
import glob as _glob, json as _json, sys as _sys, time as _time
with open(f"facts{os.environ.get('RANK', '')}.json.tmp", "w") as _file:
    _json.dump({"name": __name__, "file": __file__, "argv": _sys.argv, "path0": _sys.path[0],
                "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                "threads": torch.get_num_threads(), "own_session": os.getsid(0) == os.getpid(),
                "unbuffered": _sys.stdout.write_through,
                "other_scripts_imports": [m for m in ("torchvision", "transformers", "datasets")
                                          if m in _sys.modules]}, _file)
os.rename(_file.name, _file.name[:-len(".tmp")])
while len(_glob.glob("facts*.json")) < int(os.environ.get("WORLD_SIZE", "1")):
    _time.sleep(0.01)
print("printed before exiting")
raise SystemExit(3)
"""


@pytest.mark.parametrize("launcher", ["torchrun", "python"])
def test_a_forked_worker_sees_what_a_new_process_sees(tmp_path, launcher):
    script = script_with_lines("fsdp2_transformer.py", tmp_path,
                               "from torch.utils.data import DataLoader\n", FACTS)
    args = ["--steps", 1, "--metrics-json", "metrics.json"]
    command = (torchrun_command(script, args, 2) if launcher == "torchrun"
               else [sys.executable, script, *args])

    def seen(status, stdout):
        """(exit status, times the script printed its line, the facts files, which go)."""
        files = sorted(tmp_path.glob("facts*.json"))
        facts = [json.loads(path.read_text()) for path in files]
        for path in files:
            path.unlink()
        return status, stdout.count("printed before exiting"), facts

    proc = subprocess.run([str(c) for c in command], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    new = seen(proc.returncode, proc.stdout)
    run = run_command(command, tmp_path, timeout=120)
    forked = seen(run.returncode, run.stdout)
    ranks = 2 if launcher == "torchrun" else 1
    assert new[1:] == (ranks, [{
        "name": "__main__", "file": str(script), "argv": [str(script), *map(str, args)],
        "path0": str(tmp_path), "cwd": str(tmp_path),
        "rank": str(rank) if launcher == "torchrun" else None,
        # torchrun gives each worker 1 thread and -u; python keeps torch's default and
        # PYTHONUNBUFFERED
        "threads": 1 if launcher == "torchrun" else new[2][0]["threads"],
        "own_session": launcher == "torchrun",
        "unbuffered": launcher == "torchrun" or new[2][0]["unbuffered"],
        "other_scripts_imports": []} for rank in range(ranks)]), new
    # status: torchrun's 1 for a failed worker, python's own 3
    assert new[0] == (1 if launcher == "torchrun" else 3)
    if launcher == "python":  # forked: in its own session, unbuffered (no output is lost)
        forked[2][0].update(own_session=False, unbuffered=new[2][0]["unbuffered"])
    assert forked == new


# Put after the script's imports: each rank's priority, and whether it was forked, then exit
PRIORITY = """
import json as _json
_group = "/proc/self/autogroup"
with open(f"priority{os.environ['RANK']}.json", "w") as _file:
    _json.dump({"nice": os.nice(0),
                "forked": "forked_torchrun.py" in open("/proc/self/cmdline").read(),
                "autogroup": os.path.exists(_group)
                and open(_group).read().rstrip().endswith(" nice 19")}, _file)
raise SystemExit(0)
"""


def test_a_run_in_the_background_is_forked_at_the_lowest_priority(tmp_path):
    """A torchrun run that conftest's Idle starts (its queue's: TP's, LoRA's compiled run, the
    lessons' copies) is forked as the tests' runs are, and each of its workers runs at nice 19,
    as does, where Linux groups a session's processes for scheduling, its session's group; the
    test session keeps its own priority."""
    script = script_with_lines("fsdp2_transformer.py", tmp_path,
                               "from torch.utils.data import DataLoader\n", PRIORITY)
    own = (os.nice(0), Path("/proc/self/autogroup").read_text())
    status, stdout, stderr = Idle(None, torchrun_command(script, [], 2), tmp_path).wait(120)
    assert status == 0, stdout + stderr
    grouped = autogroups()
    assert [json.loads((tmp_path / f"priority{rank}.json").read_text()) for rank in (0, 1)] == [
        {"nice": 19, "forked": forks(os.environ), "autogroup": grouped}] * 2
    assert (os.nice(0), Path("/proc/self/autogroup").read_text()) == own


def torch_imports(stderr):
    """How many of a run's processes imported torch, from PYTHONPROFILEIMPORTTIME's lines
    ("import time: self | cumulative | module"): a forked process has it already."""
    return sum(line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == "torch"
               for line in stderr.splitlines())


def test_with_forks_switched_off_a_run_is_new_processes_with_the_same_losses(tmp_path):
    """FSDP_TESTS_FORK=0 in a run's environment: torchrun and its workers start as new Pythons
    (each imports torch, which PYTHONPROFILEIMPORTTIME shows) and learn as the forked run does."""
    command = torchrun_command("fsdp2_transformer.py", [*FSDP2_TINY, "--steps", 2], 2)
    forked = run_command(command, tmp_path, timeout=120)
    new = run_command(command, tmp_path, timeout=120,
                      env={SWITCH: "0", "PYTHONPROFILEIMPORTTIME": "1"})
    assert forked.returncode == new.returncode == 0, new.output
    # torchrun's agent and both workers imported torch: none was forked (a forked agent's workers
    # are new processes only when the run's environment differs, as here: 2 at most)
    assert torch_imports(new.stderr) == 3, new.stderr
    assert new.metrics["losses"] == forked.metrics["losses"]


class Handler:
    """Shaped as torchrun's SubprocessHandler is where fork_workers_from replaces _popen (never
    made: hook_as_expected reads only its source and signatures)."""

    def __init__(self, args, env, stdout, stderr):
        self._stdout, self._stderr = stdout, stderr  # the files a worker writes to
        self.proc = self._popen(args, env)

    def _popen(self, args, env):
        return subprocess.Popen(args, env=env, stdout=self._stdout, stderr=self._stderr)


class RenamedOutputs(Handler):
    def __init__(self, args, env, stdout, stderr):
        self.stdout, self.stderr = stdout, stderr
        self.proc = self._popen(args, env)


@pytest.mark.parametrize("handler", [
    type("Handler", (), {"__init__": Handler.__init__}),
    type("Handler", (Handler,), {"_popen": lambda self, args, env, options: None}),
    type("Handler", (Handler,), {"_popen": lambda self, command, env: None}),
    type("Handler", (Handler,), {"_popen": staticmethod(lambda args, env: None)}),
    RenamedOutputs,
], ids=["_popen missing", "_popen(self, args, env, options)", "_popen(self, command, env)",
        "static _popen(args, env)", "_stdout and _stderr renamed"])
def test_the_hook_check_refuses_a_changed_handler(handler):
    assert hook_as_expected(Handler)
    assert not hook_as_expected(handler)


def test_when_torchruns_hook_changes_every_run_is_a_new_process(tmp_path, monkeypatch):
    """The installed SubprocessHandler's _popen given another signature: the session's check, made
    again here, fails, and run_command starts torchrun and its workers as new processes."""
    handler = importlib.import_module(forked_torchrun.HANDLER_MODULE).SubprocessHandler
    monkeypatch.setattr(handler, "_popen", lambda self, args, env, options: None)
    assert not hook_as_expected(handler)
    check = functools.cache(forked_torchrun.torchrun_hook_as_expected.__wrapped__)
    monkeypatch.setattr(forked_torchrun, "torchrun_hook_as_expected", check)
    run = run_command(torchrun_command("fsdp2_transformer.py", ["--help"], 2), tmp_path,
                      timeout=60, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert run.returncode == 0 and run.stdout.count("usage:") == 2, run.output
    assert torch_imports(run.stderr) == 3, run.stderr  # forked: 2 (new workers, as env differs)


def test_where_a_cuda_device_is_every_run_is_a_new_process(tmp_path, monkeypatch):
    """On a machine with a CUDA device (cuda_devices, made to say 1 here) run_command starts
    torchrun and its workers as new processes: a worker forked from a server whose imports
    initialized CUDA cannot use it (on an H200, 8 of the 9 GPU tests failed so)."""
    monkeypatch.setattr(forked_torchrun, "cuda_devices", lambda: 1)
    assert not forked_torchrun.forks(dict(os.environ))
    run = run_command(torchrun_command("fsdp2_transformer.py", ["--help"], 2), tmp_path,
                      timeout=60, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert run.returncode == 0 and run.stdout.count("usage:") == 2, run.output
    assert torch_imports(run.stderr) == 3, run.stderr  # forked: 2 (new workers, as env differs)
