"""torchrun's agent and its workers, forked from processes that have imported torch once.

conftest.run_command starts torchrun this way rather than as new Pythons that import torch again
(2.4 s of CPU, and a script's imports 3-7 s, in each of a run's processes). What runs is
unchanged: the agent, forked from a process that imported torch.distributed.run, runs torchrun's
own main(); its workers are forked from a server per script that imported what the script
imports, each running the script's file as `__main__` with torchrun's environment, arguments and
output, in a session of its own. A run whose environment differs from the server's starts its
workers as new processes. With FSDP_TESTS_FORK=0, on a machine with a CUDA device, or when
torchrun's private hook is not what fork_workers_from replaces, every run is a new process
(NewAgent stands for ForkedAgent): the suite passes the same, only slower. Each forked agent
imports this module: it stays small.
"""
import ast
import atexit
import contextlib
import functools
import importlib
import inspect
import io
import multiprocessing
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

AGENTS = multiprocessing.get_context("forkserver")
AGENTS.set_forkserver_preload(["torch.distributed.run", "forked_torchrun"])
SWITCH = "FSDP_TESTS_FORK"  # FSDP_TESTS_FORK=0: every run is a new process
# FSDP_TESTS_IDLE=1 in a run's environment: its processes run at the lowest priority
IDLE_VARIABLE = "FSDP_TESTS_IDLE"
# the module of the private hook that fork_workers_from replaces
HANDLER_MODULE = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"


def forks(env):
    """Whether a run with env is forked: not with FSDP_TESTS_FORK=0 in env, nor on a machine with
    a CUDA device (cuda_devices), nor when torchrun's hook is not what this module expects (then
    every run of the session is a new process)."""
    return env.get(SWITCH) != "0" and not cuda_devices() and torchrun_hook_as_expected()


@functools.cache
def cuda_devices():
    """The CUDA devices this machine has, counted without initializing CUDA (torch counts them
    with NVML). Where there are any, every run is a new process: a process forked after CUDA was
    initialized cannot use CUDA, and what a server imports may initialize it (on an H200, 8 of the
    9 GPU tests failed in torch.cuda.set_device: "Cannot re-initialize CUDA in forked
    subprocess"). A GPU machine has the cores that new processes need."""
    import torch

    return torch.cuda.device_count()


@functools.cache
def torchrun_hook_as_expected():
    """hook_as_expected for the installed torch, checked once per session."""
    try:
        module = importlib.import_module(HANDLER_MODULE)
    except ImportError:
        return False
    return hook_as_expected(getattr(module, "SubprocessHandler", None))


def hook_as_expected(handler):
    """Whether handler (torchrun's SubprocessHandler class) is what fork_workers_from replaces: a
    _popen(self, args, env) that __init__ calls, after opening self._stdout and self._stderr (the
    files a forked worker writes to). A private method can change in any torch release."""
    try:
        parameters = list(inspect.signature(handler._popen).parameters)
        init = inspect.getsource(handler.__init__)
    except (AttributeError, TypeError, ValueError, OSError):  # missing, or not Python source
        return False
    return parameters == ["self", "args", "env"] and all(
        f"self.{name}" in init for name in ("_stdout", "_stderr", "_popen("))


def forked_torchrun(args, cwd, timeout, env):
    """torchrun args in cwd with env, as a forked agent: (exit status, stdout, stderr)."""
    with tempfile.TemporaryDirectory() as logs:
        outputs = (os.path.join(logs, "stdout"), os.path.join(logs, "stderr"))
        agent = ForkedAgent(args, cwd, env, outputs)
        try:
            agent.wait(timeout)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
            raise
        return (agent.returncode, *read(outputs))


class ForkedAgent:
    """What a test uses of the subprocess.Popen of `torchrun args` (pid, poll, wait, kill,
    returncode), for a forked agent that writes to the files at outputs (stdout, stderr); and
    workers(), since its workers are not its children (nor is their RANK in /proc/PID/environ,
    which shows the environment a process was exec'd with). new_session: the agent leads a session
    of its own, as Popen's start_new_session (a terminal's job, which Ctrl-C signals as a group)."""

    def __init__(self, args, cwd, env, outputs, new_session=False):
        self.args = [str(arg) for arg in args]
        script = next((arg for arg in self.args if arg.endswith(".py")), None)
        server = worker_server(script, env) if script else None
        self.started = tempfile.NamedTemporaryFile(prefix="workers-", suffix=".txt")
        self.process = AGENTS.Process(target=torchrun_agent, args=(
            self.args, cwd, env, outputs, server, self.started.name, new_session))
        self.process.start()
        self.pid = self.process.pid

    def workers(self):
        """{rank: pid} of the workers the agent started last (a restart's replace the first)."""
        with open(self.started.name) as f:
            return {int(rank): int(pid) for rank, pid in (line.split() for line in f)}

    @property
    def returncode(self):
        return self.process.exitcode  # -N when killed by signal N, as Popen's

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(["torchrun", *self.args], timeout)
        return self.returncode

    def kill(self):
        self.process.kill()


class NewAgent(subprocess.Popen):
    """ForkedAgent where forks() is False: the torchrun command as a new process (Popen) writing
    to the files at outputs, and workers(), which finds them as a test did before forks."""

    def __init__(self, command, cwd, env, outputs, new_session=False):
        with contextlib.ExitStack() as files:
            stdout = files.enter_context(open(outputs[0], "w"))
            if outputs[1] == outputs[0]:  # one file: stderr into stdout's, as `2>&1`
                stderr = subprocess.STDOUT
            else:
                stderr = files.enter_context(open(outputs[1], "w"))
            super().__init__([str(arg) for arg in command], cwd=cwd, env=env, stdout=stdout,
                             stderr=stderr, start_new_session=new_session)

    def workers(self):
        """{rank: pid} of its children with RANK in the environment they were started with: its
        workers (a restart's replace the first, which are gone by then)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:  # after the command name: state, parent
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:  # gone meanwhile
                continue
            if parent == self.pid and b"RANK" in env:
                found[int(env[b"RANK"])] = int(pid)
        return found


def forked_python(args, cwd, timeout, env):
    """`python script args` in cwd with env, forked from the script's server: (exit status,
    stdout, stderr); None when the server cannot run it (env is not its environment)."""
    if not worker_server(args[0], env):
        return None
    with tempfile.TemporaryDirectory() as logs:
        outputs = (os.path.join(logs, "stdout"), os.path.join(logs, "stderr"))
        process = start_python(args, cwd, env, outputs)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        return (process.returncode, *read(outputs))


def start_python(args, cwd, env, outputs):
    """`python script args` in cwd with env, forked from the script's server and not waited for:
    what a test uses of its Popen (pid, poll, wait, returncode), writing to the files at outputs
    (stdout, stderr), in a session of its own (run_worker); None when the server cannot run it."""
    server = worker_server(args[0], env)
    if not server:
        return None
    with open(outputs[0], "w") as stdout, open(outputs[1], "w") as stderr:
        return ForkedWorker(server[0], args, env, cwd, stdout.fileno(), stderr.fileno())


def read(outputs):
    return [Path(path).read_text(errors="replace") for path in outputs]


def torchrun_agent(args, cwd, env, outputs, server, started, new_session):
    """In the forked process: what `torchrun args` does, ending with its exit status. Each worker
    it starts adds a line `RANK pid` to the file `started`."""
    if new_session:
        os.setsid()
    lower_priority(env)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(outputs[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    if outputs[1] == outputs[0]:  # one file, one offset: as a shell's `> log 2>&1`
        os.dup2(1, 2)
    else:
        os.dup2(os.open(outputs[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = ["torchrun", *args]
    fork_workers_from(server, started)
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


# --- the worker servers, seen from the test session -------------------------------------------

SERVERS = {}  # script name -> (socket address, environment it was started with)
SERVERS_LOCK = threading.Lock()  # the bad-input table starts runs from threads
LIFELINE = []  # the write end of a pipe the servers watch: they end when the session does


def worker_server(script, env):
    """(address, script name) of the server for `script`'s workers, started on first use; None
    when env is not the one it was started with (its imports may have read the environment), or
    for a script that is not one of the four (or a changed copy of one)."""
    name = Path(script).name
    if not (Path(__file__).resolve().parent.parent / name).exists():
        return None
    with SERVERS_LOCK:
        if name not in SERVERS and imports_read(env) == imports_read(os.environ):
            if not LIFELINE:
                read_end, write_end = os.pipe()
                LIFELINE[:] = [read_end, write_end]
            folder = tempfile.mkdtemp(prefix="workers-")
            address = os.path.join(folder, "socket")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)  # clients may connect now; the server accepts once it imported
            listener.listen(64)
            # without IDLE_VARIABLE: the server runs in the test session, whose scheduling group
            # conftest lowers where a process of it has IDLE_VARIABLE=1 in its environment
            server_env = {key: value for key, value in env.items() if key != IDLE_VARIABLE}
            subprocess.Popen([sys.executable, __file__, script, str(listener.fileno()),
                              str(LIFELINE[0])], env=server_env,
                             pass_fds=(listener.fileno(), LIFELINE[0]), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(folder, "server.log"), "w"), cwd=folder)
            listener.close()
            SERVERS[name] = (address, imports_read(env))
        address, server_env = SERVERS.get(name, (None, None))
    return (address, name) if imports_read(env) == server_env else None


def imports_read(env):
    """What importing may read of an environment: all of it but the name of the current test,
    OMP_NUM_THREADS (each worker applies its own), TORCHFT_LIGHTHOUSE (torchft reads it as a
    worker makes its Manager, not on import; a replica group's job, which has it, then forks),
    IDLE_VARIABLE (each agent and worker applies its own: lower_priority) and
    TORCHINDUCTOR_CACHE_DIR: inductor sets it in the test session's own environment, to the
    folder it would use anyway, when the session first names its cache (building a model there
    on the meta device does); a server started before, from a run queued as the session starts,
    then refused every later run of its script (each became new processes)."""
    return {key: value for key, value in env.items() if key not in (
        "PYTEST_CURRENT_TEST", "OMP_NUM_THREADS", "TORCHFT_LIGHTHOUSE", IDLE_VARIABLE,
        "TORCHINDUCTOR_CACHE_DIR")}


def autogroups():
    """Whether Linux groups each session's processes for scheduling (autogroup), a nice counting
    only within its group."""
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return enabled.exists() and enabled.read_text().strip() == "1"


def lower_priority(env):
    """In a forked agent or worker, with IDLE_VARIABLE=1 in its run's environment: nice 19, as
    conftest's Idle starts its new processes; and, where Linux groups each session's processes
    for scheduling (autogroup, in which a nice counts only within the group), its session's group
    too, if it leads that session (never the test session's). Whatever it starts inherits both."""
    if env.get(IDLE_VARIABLE) != "1":
        return
    os.nice(19 - os.nice(0))
    if os.getsid(0) == os.getpid() and autogroups():
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text("19")


# --- in the agent: its workers, from the server -----------------------------------------------

def fork_workers_from(server, started):
    """Make torchrun's SubprocessHandler fork `python -u <script_name> ...` from the server
    (address, script name), if any; and note each worker's rank and pid in the file `started`."""
    subprocess_handler = importlib.import_module(HANDLER_MODULE)
    new_process = subprocess_handler.SubprocessHandler._popen

    def _popen(handler, args, env):
        if server and list(args[:2]) == [sys.executable, "-u"] and Path(args[2]).name == server[1]:
            # it writes to the same open files as the agent's stdout and stderr, or to torchrun's
            # redirect files
            outputs = [file.fileno() if file else fd
                       for file, fd in ((handler._stdout, 1), (handler._stderr, 2))]
            worker = ForkedWorker(server[0], args[2:], env, os.getcwd(), *outputs)
        else:
            worker = new_process(handler, args, env)
        with open(started, "a") as f:
            f.write(f"{env['RANK']} {worker.pid}\n")
        return worker

    subprocess_handler.SubprocessHandler._popen = _popen


class ForkedWorker:
    """What torchrun uses of the subprocess.Popen of a worker (pid, poll, wait, returncode), for a
    worker forked by the server: its exit status comes over the connection."""

    def __init__(self, address, args, env, cwd, stdout, stderr):
        """Run `python args` (a script and its arguments) with env in cwd, writing to the file
        descriptors stdout and stderr."""
        self.args, self.returncode = args, None
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connection.connect(address)
        request = pickle.dumps((list(map(str, args)), dict(env), str(cwd)))
        socket.send_fds(self.connection, [struct.pack("Q", len(request))], [stdout, stderr])
        self.connection.sendall(request)
        self.pid = struct.unpack("q", receive(self.connection, 8))[0]

    def poll(self):
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self.connection], [], [], timeout)[0]:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(["torchrun", *self.args], timeout)
            status = receive(self.connection, 4)
            # a server gone without a word (the session ended): as if killed
            self.returncode = struct.unpack("i", status)[0] if status else -signal.SIGKILL
            self.connection.close()
        return self.returncode


def receive(connection, size):
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


# --- the server --------------------------------------------------------------------------------

def serve(script, listener, lifeline):
    """Import what script imports, then fork a worker for each request. Returns only in a worker:
    (its request, what importing printed on stdout and stderr)."""
    printed = preload(script)
    import gc
    gc.freeze()  # the imported objects stay shared with the workers, not copied by collections
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # no zombies: each request's manager is reaped
    while True:
        ready = select.select([listener, lifeline], [], [])[0]
        if lifeline in ready:  # the session is over: its socket and log go too
            shutil.rmtree(os.path.dirname(listener.getsockname()), ignore_errors=True)
            os._exit(0)
        connection = listener.accept()[0]
        if os.fork() == 0:  # this request's manager: forks the worker, reports its exit status
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            listener.close()
            os.close(lifeline)
            request = manage(connection)
            return request, printed
        connection.close()


def manage(connection):
    header, (stdout, stderr), _, _ = socket.recv_fds(connection, 8, 2)
    request = pickle.loads(receive(connection, struct.unpack("Q", header)[0]))
    pid = os.fork()
    if pid == 0:
        connection.close()
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        return request
    os.close(stdout)
    os.close(stderr)
    connection.sendall(struct.pack("q", pid))
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # -N when killed by signal N
    connection.sendall(struct.pack("i", status))
    os._exit(0)


# By script: modules that torch imports only when first used, during every run of the script.
# Building fsdp2's model on the meta device imports torch._dynamo (torch._refs' normal_, under
# torch._disable_dynamo): 2.3 s of CPU in each worker, profiled with py-spy. Its server imports it
# once; the other scripts' runs never import it, and their workers do not see it.
IMPORTED_LATER = {"fsdp2_transformer.py": ["torch._dynamo"]}
# Not imported by a server: torchft sets up its logging (Rust's) as it is imported, from RUST_LOG,
# which fsdp2_transformer.py sets just before importing it; a worker imports it (0.1-0.2 s of CPU).
NOT_PRELOADED = ("torchft",)


def preload(script):
    """Import the modules script imports (and those its own modules beside it import), and its
    IMPORTED_LATER; return what that printed, captured from file descriptors 1 and 2."""
    folder = str(Path(script).resolve().parent)
    sys.path.insert(0, folder)
    saved = [os.dup(1), os.dup(2)]
    captured = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    for fd, file in zip((1, 2), captured):
        os.dup2(file.fileno(), fd)
    try:
        later = IMPORTED_LATER.get(Path(script).name, [])
        for name in [*imported_by(Path(script), set()), *later]:
            if name.split(".")[0] in NOT_PRELOADED:
                continue
            try:
                importlib.import_module(name)
            except Exception:  # the worker will meet it, and say so, as a new Python would
                pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        sys.path.remove(folder)
    printed = []
    for file in captured:
        file.seek(0)
        printed.append(file.read())
    return printed


def imported_by(path, seen, root=None):
    """The modules a file's import statements name, except those beside the script (root: its
    folder), modules and packages (whose own imports are listed instead): a worker of a changed
    copy must import its own."""
    root, names = root or path.parent, []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            files = {alias.name: root / (alias.name.replace(".", "/") + ".py")
                     for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            files = {node.module: root / (node.module.replace(".", "/") + ".py")}
        elif isinstance(node, ast.ImportFrom):  # relative: a module of the same package
            files = {None: path.parent / ((node.module or "__init__") + ".py")}
        else:
            continue
        for module, local in files.items():
            ours = module is None or local.exists() or (root / module.split(".")[0]).is_dir()
            if not ours:
                names.append(module)
            elif local.exists() and local not in seen:
                seen.add(local)
                names += imported_by(local, seen, root)
    return names


def run_worker(request, printed):
    """In the forked worker: what `python -u script args` does with torchrun's environment."""
    args, env, cwd = request
    atexit.register(unfreeze_for_nanobind)
    os.setsid()  # as torchrun starts it: it signals the worker's process group
    lower_priority(env)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    threads = int(env.get("OMP_NUM_THREADS", "0") or 0)  # torchrun gives each worker 1
    if threads:  # a new Python's OpenMP would read it as it loads
        import torch
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    for fd, text in zip((1, 2), printed):
        os.write(fd, text)
    # -u: unbuffered, in order with what the C++ side writes to the same files
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors,
                         write_through=True)
        for fd, errors in ((1, "strict"), (2, "backslashreplace")))
    script = os.path.abspath(args[0])
    sys.argv = [args[0], *args[1:]]
    sys.path[0] = os.path.dirname(script)
    main = type(sys)("__main__")
    main.__file__ = script
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)


def unfreeze_for_nanobind():
    """At exit, as a new Python: the objects the server froze (gc.freeze) are never freed, and an
    extension built with nanobind (triton >= 3.9, which transformers and torchvision import)
    reports each of its objects still alive when Python ends as a leak, which a new Python would
    have freed. Then they are unfrozen, and the last collection frees them (0.9 s of CPU, which
    the freeze saves otherwise). nanobind's classes are instances of its metaclass, whose module
    is "nanobind" (type() only: an attribute read can warn)."""
    import gc
    for module in list(sys.modules.values()):
        values = list(getattr(module, "__dict__", {}).values())  # sys.modules may hold None
        if any(type(value).__module__ == "nanobind" for value in values):
            gc.unfreeze()
            return


if __name__ == "__main__":
    run_worker(*serve(sys.argv[1], socket.socket(fileno=int(sys.argv[2])), int(sys.argv[3])))
