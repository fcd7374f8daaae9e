"""torchrun's agent, forked from a process that has imported torch.distributed.run once.

conftest.run_command starts torchrun this way rather than as a new Python that imports torch
again: each launch starts 1.8 s sooner, a third of a short run and minutes over the suite. The
agent runs torchrun's own main() with the same arguments, environment and folder; the workers it
starts are new processes, as under torchrun. (Tests that signal or kill a job, or start two
agents, start TORCHRUN as a command.) This module stays small: each forked agent imports it.
"""
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

AGENTS = multiprocessing.get_context("forkserver")
AGENTS.set_forkserver_preload(["torch.distributed.run", "forked_torchrun"])


def forked_torchrun(args, cwd, timeout, env):
    """torchrun args in cwd with env, as a forked agent: (exit status, stdout, stderr)."""
    with tempfile.TemporaryDirectory() as logs:
        outputs = (os.path.join(logs, "stdout"), os.path.join(logs, "stderr"))
        agent = AGENTS.Process(target=torchrun_agent, args=(args, cwd, env, outputs))
        agent.start()
        agent.join(timeout)
        if agent.exitcode is None:
            agent.kill()
            agent.join()
            raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
        stdout, stderr = (Path(path).read_text(errors="replace") for path in outputs)
        return agent.exitcode, stdout, stderr


def torchrun_agent(args, cwd, env, outputs):
    """In the forked process: what `torchrun args` does, ending with its exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in zip((1, 2), outputs):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["torchrun", *args]
    status = 0
    try:
        from torch.distributed.run import main
        main()
    except SystemExit as e:  # as Python ends on it
        status = e.code if isinstance(e.code, int) or e.code is None else 1
        if status == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # as Python ends on it: the traceback, status 1
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
