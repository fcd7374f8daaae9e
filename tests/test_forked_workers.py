"""The suite's own machinery: a worker forked from a server (forked_torchrun.py) sees what a new
Python process sees, under torchrun and under plain python, and ends the same way."""
import json
import subprocess
import sys

import pytest
from conftest import run_command, script_with_lines, torchrun_command

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
