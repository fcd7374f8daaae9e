"""What the four scripts share, so that each of them can be its lesson: launching, the process
group, one error line instead of a traceback per rank, safe saves, divergence checks, the run's
report and the flags every script has. Copy it beside the script you copy.

A script hands it what it needs as values and never the other way round (this module imports no
script): launch(args, Script(main=..., check_flags=..., resume_hint=..., memory_advice=...)) runs
main(args, device) on every rank, however the job was started:

    python SCRIPT.py                     spawns one process per GPU (or --world-size, 2 on CPU)
    torchrun ... SCRIPT.py               runs in each worker torchrun started
    srun python SCRIPT.py                one job of SLURM's tasks (slurm_environment)
    Ray Train, Kubeflow (PET_*)          joins the process group the framework made / torchrun's

and ends it in one line where it fails: bad input (fail, agree_on_error), a full disk (saving),
memory (the script's memory_advice), a lost peer (--dist-timeout), Ctrl-C or SIGTERM (where a
rerun resumes: the script's resume_hint). What a run must remember across those calls lives
here: FAILING, PROGRESS (where training is, for the line of an interrupted run), HELD_LOCKS.
"""
import argparse
import contextlib
import ctypes
import datetime
import errno
import fcntl
import gc
import glob
import json
import logging
import math
import multiprocessing.connection
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.optim.optimizer import register_optimizer_step_pre_hook


class Script(NamedTuple):
    """What a script hands launch: main(args, device), which runs on every rank;
    check_flags(args, device, world_size), which refuses flags this device or world size cannot
    honour before any process group starts (None: no such flags); resume_hint(args), or a fixed
    text, saying where a rerun resumes when Ctrl-C stops the run; memory_advice, the advice of the
    line that says memory ran out."""
    main: Callable
    check_flags: Callable | None
    resume_hint: Callable | str
    memory_advice: str


# ------------------------------------------------------------------------------------ launching
def launch(args, script):
    """Run script.main(args, device) on every rank. Under torchrun, in this process; under srun
    without torchrun, in this process as the task SLURM made it; started with python, in
    --world-size processes it spawns (default: one per GPU, or 2 on CPU) that meet on a free port
    of this machine."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    launcher = "torchrun"
    if "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:  # a task of srun's
        launcher = "srun"
        os.environ.update(slurm_environment())
        share_the_cores(int(os.environ["LOCAL_WORLD_SIZE"]))
    if "RANK" in os.environ:
        if args.world_size not in (None, int(os.environ["WORLD_SIZE"])):
            if launcher == "srun" and os.environ["RANK"] != "0":
                sys.exit(1)  # every task sees it and rank 0 says it; srun would not stop this one
            fail(f"--world-size {args.world_size} disagrees with the {os.environ['WORLD_SIZE']} "
                 f"processes {launcher} started; leave --world-size out under {launcher}")
        return run_worker(args, use_cuda, script)
    gpus = torch.cuda.device_count() if use_cuda else 0
    world_size = args.world_size or gpus or 2
    if world_size > gpus > 0:
        fail(f"--world-size {world_size} asks for more GPUs than the {gpus} present")
    if script.check_flags:  # before spawning
        script.check_flags(args, torch.device("cuda:0" if use_cuda else "cpu"), world_size)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = mp.spawn(spawn_worker, args=(args, use_cuda, world_size, port, script),
                       nprocs=world_size, join=False).processes
    signalled = []  # when

    def pass_on(signum, frame):  # Ctrl-C, or a kill of this process: the workers stop themselves
        signalled.append(time.monotonic())
        for worker in workers:
            if worker.exitcode is None:
                os.kill(worker.pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, pass_on)
    # Wait until all end well, or one fails: it has said why, and the others are stopped without
    # a word (SIGKILL: a SIGTERM they would take for Ctrl-C). After a signal, they stop on their
    # own (rank 0 says where a rerun resumes), within 30 s.
    while any(w.exitcode is None for w in workers) and (
            all(w.exitcode in (None, 0) for w in workers) or signalled):
        multiprocessing.connection.wait([w.sentinel for w in workers if w.exitcode is None], 1)
        if signalled and time.monotonic() - signalled[0] > 30:
            break
    failed = next((w.exitcode for w in workers if w.exitcode), 0)
    for worker in workers:
        worker.kill()
        with contextlib.suppress(ProcessLookupError):  # with what it started (a worker's group)
            os.killpg(worker.pid, signal.SIGKILL)
        worker.join()
    sys.exit(failed if failed >= 0 else 128 - failed)  # killed by signal N: exit code -N


def spawn_worker(rank, args, use_cuda, world_size, port, script):
    # What torchrun would set, so that both ways to launch run the same code.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    share_the_cores(world_size)
    # A process group of its own, with the processes it starts (DCP's checkpoint writer), as
    # torchrun gives each worker: launch stops them all at once (killpg).
    os.setpgid(0, 0)
    # mp.spawn makes "spawn" this process's start method; a worker torchrun starts has Python's
    # default. With "spawn", DataLoader workers start a new Python each, and the semaphores that
    # libraries make (tqdm's lock, in datasets.load_dataset) are registered for cleanup at a normal
    # exit: one that ends through os._exit (an error line, Ctrl-C) then leaves "resource_tracker:
    # There appear to be 2 leaked semaphore objects to clean up at shutdown".
    multiprocessing.set_start_method(None, force=True)
    try:
        run_worker(args, use_cuda, script)
    except Exception:
        # mp.spawn keeps a worker's traceback for its join(), which launch does not call (it waits
        # on the workers itself): printed here, or a bug would end the run in silence, status 1.
        traceback.print_exc()
        raise


def slurm_environment():
    """torchrun's variables for a task that SLURM's srun started without torchrun (srun python
    SCRIPT.py): the step's tasks are one job, ranked by SLURM, meeting on the first node of the
    step at a port derived from the job and step ids (MASTER_ADDR, MASTER_PORT override them)."""
    per_node = []  # SLURM_STEP_TASKS_PER_NODE: "2(x3),1" is 2, 2, 2, 1
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?",
                                    os.environ["SLURM_STEP_TASKS_PER_NODE"]):
        per_node += [int(count)] * int(repeat or 1)
    step = int(os.environ["SLURM_JOB_ID"]) * 16 + int(os.environ.get("SLURM_STEP_ID", 0))
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_STEP_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return {"RANK": os.environ["SLURM_PROCID"], "LOCAL_RANK": os.environ["SLURM_LOCALID"],
            "WORLD_SIZE": os.environ["SLURM_STEP_NUM_TASKS"],
            "LOCAL_WORLD_SIZE": str(per_node[int(os.environ["SLURM_NODEID"])]),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", nodes[0]),
            "MASTER_PORT": os.environ.get("MASTER_PORT", str(20000 + step % 40000))}


def share_the_cores(processes):
    """As torchrun does for the processes it starts on a node: each takes its share of the cores
    (unless OMP_NUM_THREADS says otherwise), not all of them."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


@record  # an unexpected exception reaches torchrun's report as the root cause
def run_worker(args, use_cuda, script):
    """script.main(args, device) in this process's process group; a lost peer or Ctrl-C ends it
    in one line. Where a framework made the group already (Ray Train's TorchTrainer runs launch in
    its workers), this process joins no other and takes the GPU it was given."""
    made_here = not dist.is_initialized()
    if threading.current_thread() is threading.main_thread():  # not in Ray's: its signals
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: stop_on_signal(signum, args, script))
    gpus, local_world_size = torch.cuda.device_count(), int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda and local_world_size > gpus:
        fail(f"{local_world_size} processes on this node but {gpus} GPUs visible to each; start "
             "at most one per GPU (torchrun --nproc_per_node, srun --ntasks-per-node), each seeing "
             "all of the node's GPUs", node_local=True)
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
    if use_cuda and not made_here:
        device = torch.device("cuda", torch.cuda.current_device())
    if use_cuda:
        torch.cuda.set_device(device)
    elif args.return_freed_memory:
        return_freed_memory()
    # The script's flag checks, before any process group: a bad input fails at once, also each of
    # torchrun's --max-restarts retries (torchrun retries every failure; nothing says "final").
    if script.check_flags:
        script.check_flags(args, device, int(os.environ["WORLD_SIZE"]))
    try:  # a collective that waits longer than --dist-timeout for a peer fails, not hangs
        if made_here:
            init_process_group("nccl" if use_cuda else "gloo",
                               datetime.timedelta(seconds=args.dist_timeout),
                               device if use_cuda else None)
        RUN["script"] = os.path.basename(script.main.__code__.co_filename)  # for the report
        script.main(args, device)  # its model and optimizer are garbage once it returns
    except (torch.OutOfMemoryError, MemoryError) as e:
        fail(f"out of memory ({' '.join(str(e).split()).split('. ')[0]}): {script.memory_advice}")
    except RuntimeError as e:
        reason = re.search(r"can't allocate memory[^.]*", str(e))  # a failed CPU allocation
        if reason:
            fail(f"out of memory ({reason[0]}): {script.memory_advice}")
        if not (isinstance(e, dist.DistError) or "gloo" in str(e)):  # gloo's are RuntimeErrors
            raise
        # A peer that failed first says why, and the launcher then stops this process: give it
        # the time to, so that the root cause is the line a user sees first. (After Ctrl-C, the
        # peers that stopped first make this rank's collective fail: its handler speaks here.)
        time.sleep(5)
        reason = re.sub(r"^\[[^]]*\] ", "", str(e).strip().splitlines()[0])  # gloo's source line
        print(f"error: rank {os.environ['RANK']}: a collective failed ({reason}): another rank "
              "died, hung or lost its network, or took longer than --dist-timeout "
              f"{args.dist_timeout:g}s; see the other ranks' logs", file=sys.stderr, flush=True)
        sys.exit(1)  # said by every rank that notices: the rank that was lost may be rank 0
    finally:
        # Workaround: FSDP and DDP keep the process group alive through reference cycles; freed
        # only at exit, gloo's threads can abort a finished run with SIGABRT ("terminate called
        # without an active exception"; torch 2.14, 2.15). Free them while Python still can: when
        # main failed, the tracebacks on their way out hold its frames, hence the model: clear
        # those first (the tracebacks keep their lines for torchrun's report).
        error = sys.exc_info()[1]
        while error is not None:
            traceback.clear_frames(error.__traceback__)
            error = error.__context__
        gc.collect()
        if dist.is_initialized() and made_here:
            dist.destroy_process_group()
        if FAILING:  # Workaround, the same abort: its error line is out, so end now, before
            # the interpreter's teardown, where gloo's threads can still abort it (1 in 5 T5
            # resumes from a corrupted checkpoint kept a DeviceMesh alive; torch 2.14). Remove it
            # when that bad-input row passes 20 runs without it. A bug's traceback goes to @record.
            sys.stdout.flush()
            sys.stderr.flush()
            end_child_processes()
            os._exit(1)


def return_freed_memory():
    """--return-freed-memory, on CPU, where the tensors live: hand freed blocks of 256 KiB or more
    back to the system at once, rather than keep them for reuse as glibc does by default.

    glibc raises its mmap threshold to the size of the largest mmap'd block freed, up to 32 MiB;
    once FSDP has freed one all-gather buffer, later buffers and activations come from the heap
    and stay with the process when freed. At t5-base's shape with LoRA on 2 CPU ranks, a rank's
    anonymous memory rose 1,440 MiB above its level after loading (FSDP1; FSDP2 1,113), 718
    (460) with the threshold fixed at 256 KiB, 950 (645) at 1 MiB (each layer's attention scores
    are 0.75 MiB; 16 or 64 KiB return no more), with the same losses. The price, why it is not
    the default: each such block is mapped afresh and the kernel zeroes its pages, so that run
    took 1.30x as long (1.13x at 1 MiB), MNIST 1.30x, fsdp2_transformer.py with 55M parameters
    1.52x. The benchmarks' table "Memory returned on CPU" has every script's figures. Nothing to
    do where the C library has no mallopt (musl, macOS)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(-3, 2**18)  # M_MMAP_THRESHOLD (malloc.h): 256 KiB


def init_process_group(backend, timeout, device):
    """dist.init_process_group, with a store prefix of its own for each torchrun restart. The
    process's GPU (device; None on CPU) is bound to it, so that a barrier knows which GPU to use.

    Workaround: torchrun (torch 2.14, 2.15) shares one store between the restarts of
    --max-restarts without a prefix per restart: restarted workers read the addresses of those
    they replace and fail, "Connection refused" (as in pytorch/pytorch#167288). Remove it when
    tests/test_faults.py and tests/test_slurm.py's restart pass without it. The attempt is counted
    in that store, each worker adding one: TORCHELASTIC_RESTART_COUNT differs between nodes (an
    agent that restarts its workers because another node's failed keeps its count)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.init_process_group(backend, timeout=timeout, device_id=device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = (store.add("fsdp_workers_started", 1) - 1) // int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout, device_id=device)


def stop_on_signal(signum, args, script):
    """Ctrl-C (SIGINT) or SIGTERM: exit at once, with the status of a process killed by it (130,
    143) and one line from rank 0 saying where a rerun resumes; no traceback from any rank. An
    asynchronous checkpoint still being written stays a .tmp folder, which a resume ignores.
    Silent when this process is already ending with an error (the launcher stops the others)."""
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)  # the launcher passes the signal on: once is enough
    if int(os.environ.get("RANK", "0")) == 0 and not FAILING:
        hint = script.resume_hint
        hint = hint if isinstance(hint, str) else hint(args)
        line = f"interrupted by {signal.Signals(signum).name}{PROGRESS['at']}; {hint}\n"
        os.write(sys.stderr.fileno(), line.encode())  # not print: safe wherever Python stopped
    sys.stdout.flush()
    end_child_processes()
    os._exit(128 + signum)


def end_child_processes():
    """Before os._exit, which skips their shutdown: kill the processes this one started (DCP's
    checkpoint writer, which would otherwise outlive it and print an EOFError traceback once it
    finds its parent gone; DataLoader workers)."""
    for child in multiprocessing.active_children():
        child.kill()


# ------------------------------------------------------------ one-line errors, agreed across ranks
def rank0_print(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fail(message, node_local=False):
    """Exit 1 on this rank with one error line: rank 0 (node_local: each node's local rank 0) says
    it at once; another rank only after 10 s, which it does not live to see when rank 0 says it
    too (torchrun stops all workers once one has failed), but does when the problem is its own."""
    FAILING.append(message)  # the launcher's SIGTERM that may follow is not an interruption
    if int(os.environ.get("LOCAL_RANK" if node_local else "RANK", "0")) != 0:
        time.sleep(10)
        message = f"rank {os.environ['RANK']}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


FAILING = []  # this process is ending with an error line of its own (or a peer's)


PROGRESS = {"at": ""}  # where training is (" at step 40"), for the line of an interrupted run
RUN = {"script": None}  # the file of the script whose main runs here, for the report


def agree_on_error(error):
    """Fail on every rank if any rank found an error (a message), so that none waits for ever."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        fail(next(e for e in errors if e))


class LockStep:
    """Ranks that run different numbers of batches, or of forwards in a batch, fail in one line
    instead of hanging. Every FSDP collective waits for every rank: a rank whose loader runs out
    first, or that cuts its batch into fewer micro-batches, leaves the others waiting in their next
    all-gather until --dist-timeout, and then each says only that a collective failed.

    So the ranks check in with each other before each batch of a loop (batches) and when a loop
    runs out; given the model (where ranks may run different numbers of forwards in a batch), also
    before each of its forwards (a forward pre-hook, ahead of FSDP's own) and before each optimizer
    step (a hook of every optimizer's, ahead of theirs). Where one rank is not where the others
    are, every rank stops with a line saying which ranks ran out, or went on, where. The check-ins
    go over a gloo group of their own, on the host: no GPU waits for them. Each is an all-gather
    of 4 numbers, which also makes the ranks wait for each other (benchmarks/README.md,
    "Lock-step check")."""

    BATCH, FORWARD, OUT, STEP = range(4)
    step_hook = None  # the optimizers' hook: one, of the newest LockStep of this process

    def __init__(self, timeout_s, model=None):
        self.loops, self.batch, self.forwards = [], 0, 0  # the loops' names; where this rank is
        self.group, self.model = None, model is not None
        if dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout_s))
        if self.group and model is not None:
            model.register_forward_pre_hook(self.before_forward, prepend=True)
            if LockStep.step_hook:
                LockStep.step_hook.remove()
            # Global: it runs before each optimizer's own hooks (a check of the gradients that
            # all-reduces would otherwise wait for a rank still running its forwards).
            LockStep.step_hook = register_optimizer_step_pre_hook(
                lambda optimizer, args, kwargs: self.check_in(self.STEP, self.batch, self.forwards))

    def batches(self, loader, what, first=1):
        """loader's batches, numbered from first; what names them in an error ("training")."""
        self.loops.append(what)
        self.batch, self.forwards = first - 1, 0
        for item in loader:
            self.check_in(self.BATCH, self.batch + 1, self.forwards)  # those of the batch before
            self.batch, self.forwards = self.batch + 1, 0
            yield item
        self.check_in(self.OUT, self.batch, self.forwards)

    def before_forward(self, module, inputs):
        self.forwards += 1
        self.check_in(self.FORWARD, self.batch, self.forwards)

    def check_in(self, kind, batch, forwards):
        if self.group is None:
            return
        here = torch.tensor([len(self.loops), kind, batch, forwards])
        everyone = [torch.empty_like(here) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, here, group=self.group)
        if any(not torch.equal(there, here) for there in everyone):
            fail(self.out_of_step([there.tolist() for there in everyone]))

    def out_of_step(self, positions):
        """The line for ranks at different places: [loop, kind, batch, forwards] per rank."""
        where = {}
        for rank, (loop, kind, batch, forwards) in enumerate(positions):
            what = self.loops[loop - 1] if 0 < loop <= len(self.loops) else "no loop"
            if kind == self.OUT:
                text = f"ran out of {what} batches after batch {batch}"
            elif kind == self.STEP:
                text = (f"went on to the optimizer step after {forwards} forward(s) of {what} "
                        f"batch {batch}")
            elif kind == self.BATCH:
                text = f"went on to {what} batch {batch}" + (
                    f" after {forwards} forward(s) in batch {batch - 1}" if self.model else "")
            else:
                text = f"ran forward {forwards} of {what} batch {batch}"
            where.setdefault(text, []).append(str(rank))
        said = "; ".join(f"rank{'s' * (len(ranks) > 1)} {','.join(ranks)} {text}"
                         for text, ranks in where.items())
        return (f"ranks out of step: {said}. Every rank must run as many batches, and as many "
                "forwards in each, or FSDP's collectives wait for the missing ones until "
                "--dist-timeout: give each rank the same number of batches (DistributedSampler "
                "does), and a rank with fewer micro-batches zero-weight fillers")


def local_rank_zero_first(load):
    """load() on each node's local rank 0, then on the node's other ranks, so that downloads and
    caches are written once per node. A ValueError on any rank stops every rank with its text."""
    result = None
    for first in (True, False):
        error = None
        if (os.environ["LOCAL_RANK"] == "0") == first:
            try:
                result = load()
            except ValueError as e:
                error = str(e)
        agree_on_error(error)
    return result


# ------------------------------------------------------------------------- outputs, folders, saves
def check_outputs(args, folders, files=None):
    """Fail unless rank 0 can create a file in each {flag: folder} (made if missing) and write
    each {flag: file} and --metrics-json: a bad path then fails in seconds, not at the first save.
    """
    files = {**(files or {}), "--metrics-json": args.metrics_json}
    error = None
    for flag, path in files.items():
        if path and os.path.isdir(path):
            error = f"{flag}: {path} is a folder; pass a file's path"
        folders.setdefault(flag, os.path.dirname(os.path.abspath(path)) if path else None)
    for flag, folder in folders.items() if dist.get_rank() == 0 else ():
        try:
            if folder and not error:
                os.makedirs(folder, exist_ok=True)
                tempfile.TemporaryFile(dir=folder).close()  # the one check that holds for root too
        except OSError as e:
            problem = "is a file" if os.path.isfile(folder) else f"is not writable ({e.strerror})"
            error = f"{flag}: {folder} {problem}, so nothing can be written into it; pass another"
    agree_on_error(error)


def lock_folder(flag, folder):
    """Rank 0 holds an exclusive lock on the folder until its process ends, so that a second job
    (a double launch, a requeue) cannot write into the same folder; the kernel releases the lock
    of a job that died, so a crash never leaves it stuck. It writes no file."""
    error = None
    if dist.get_rank() == 0:
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            HELD_LOCKS.append(descriptor)  # the lock lasts as long as the descriptor is open
        except OSError:
            os.close(descriptor)
            error = (f"{flag} {folder} is in use by another job, which holds its lock; wait for it "
                     f"to end, or pass another {flag}")
    agree_on_error(error)


HELD_LOCKS = []


def newest_complete(folder, prefix, marker):
    """The checkpoint of folder to resume from, or None: the <prefix>N folder (fsdp2: step_000050,
    T5: checkpoint-epoch-2) of the highest N that holds its marker file, written last. A save cut
    short left a <prefix>N.tmp, or a folder without its marker: neither is complete."""
    complete = [path for path in glob.glob(os.path.join(glob.escape(folder), f"{prefix}*"))
                if folder_number(path, prefix) is not None
                and os.path.isfile(os.path.join(path, marker))]
    return max(complete, key=lambda path: folder_number(path, prefix), default=None)


def folder_number(path, prefix):
    """The N of a folder named <prefix>N (step_000050: 50), or None (step_000050.tmp: None)."""
    match = re.fullmatch(re.escape(prefix) + "([0-9]+)", os.path.basename(path))
    return int(match[1]) if match else None


def space_problem(folder, needed, elsewhere):
    """Why folder's filesystem cannot take `needed` more bytes (and 1 MiB to spare), or None:
    checked before a save, so that a full disk stops the run before it writes anything.
    elsewhere: how to save somewhere else ("pass another --checkpoint-dir")."""
    free = shutil.disk_usage(folder).free
    if free >= needed + 2**20:
        return None
    return (f"not enough space to save into {folder}: the save needs {needed / 2**20:,.1f} MiB, "
            f"{free / 2**20:,.1f} MiB are free; free space there (delete older checkpoints or "
            f"other files), or {elsewhere}")


@contextlib.contextmanager
def saving(path, needed, elsewhere, sharded=False):
    """Around a save to path of `needed` bytes (rank 0's; with sharded, every rank's own shards):
    first the free space is checked (by rank 0; sharded, by each node's local rank 0 for its
    ranks' bytes); then a failed write (a full disk, an I/O error) stops every rank with one line,
    and the half-written path*.tmp are removed."""
    if sharded:
        sizes, node = [None] * dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
        dist.all_gather_object(sizes, needed)
        first = dist.get_rank() // node * node  # torchrun numbers each node's ranks in a row
        needed = sum(sizes[first:first + node])
    checks = os.environ["LOCAL_RANK"] == "0" if sharded else dist.get_rank() == 0
    agree_on_error(checks and space_problem(os.path.dirname(path), needed, elsewhere) or None)
    error = None
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = write_problem(e, path, elsewhere)
        if error is None:
            raise
        for leftover in glob.glob(f"{glob.escape(path)}*.tmp") if checks else ():
            with contextlib.suppress(OSError):
                shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)
    agree_on_error(error)


def write_problem(error, path, elsewhere):
    """The one line of a failed write of path, or None if error is not one: an OSError (ENOSPC:
    no space left), torch.save's RuntimeError (its zip writer's, which names no errno), or the
    root cause of a DCP CheckpointException: its type and first sentence."""
    cause = root_cause(error)
    text = re.sub(r"^\[enforce fail at [^]]*\][ .]*", "", " ".join(str(cause).split()))
    if not isinstance(cause, (OSError, RuntimeError)) or isinstance(
            cause, (dist.DistError, torch.OutOfMemoryError)) or re.search(
            r"gloo|nccl|NCCL|allocate memory|process is dead", text):  # not the write's: a
        return None  # peer's, memory, or a writer process (DCP's) that died
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    if getattr(cause, "errno", None) == errno.ENOSPC or free < 2**20:  # torch.save names no errno
        reason = "no space left on the device"
    else:
        reason = f"{type(cause).__name__}: {text.split('. ')[0][:200]}"
    return (f"cannot write {path} ({reason}; {free / 2**20:,.1f} MiB free in {folder}); free "
            f"space there, or {elsewhere}")


def root_cause(error):
    """The exception behind a DCP CheckpointException (which holds each failed rank's exception
    with its traceback), or the error itself."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if failures else error


def state_bytes(state):
    """The bytes of the tensors in a (nested) state dict; of a DTensor, its local shard."""
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    if torch.is_tensor(state):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


# -------------------------------------------------------------------------------------- divergence
def check_compile(device):
    """--compile (fsdp2_transformer.py, t5_fsdp_finetune.py): a function compiled and run on device
    now, so that a machine that cannot build code fails in one line, not at the first step."""
    # Workaround: on a machine with a CUDA toolkit but no GPU, inductor's first import of
    # torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME=..." on every
    # rank (torch 2.14), which says nothing about a CPU run. Remove when it no longer does.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2, device=device))
    except Exception as e:
        fail(f"--compile: torch.compile cannot build code here ({str(e).strip()[:200]}); "
             "install a C++ compiler (CPU) or Triton (GPU), or drop --compile")


def stop_if_diverged(where, tensors, advice):
    """Fail on every rank, in one line, if any of the tensors (a loss, or a model's parameters) is
    NaN or infinite on any rank: a diverged run must not go on, nor save what it has become."""
    bad = torch.zeros((), device=tensors[0].device)
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensors
        bad += (~torch.isfinite(tensor.detach())).any()
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only (CPU offload, a float loss)
        bad = bad.cuda()
    dist.all_reduce(bad)
    if bad:
        fail(f"training diverged: {where} is not finite (NaN or infinite); {advice}")


def stop_on_non_finite_gradients(optimizer, advice):
    """From now on, before each optimizer step, check that every gradient is finite on every rank,
    else stop every rank in one line before the update carries NaN into the weights: a diverged
    run must not go on. Through the optimizer's step hook, so that the training loop stays plain
    (under a grad scaler, steps with inf gradients are skipped before the hook)."""
    parameters, steps = [p for group in optimizer.param_groups for p in group["params"]], []

    def check(optimizer, args, kwargs):
        steps.append(None)  # this one
        gradients = [p.grad for p in parameters if p.grad is not None]
        stop_if_diverged(f"a gradient of optimizer step {len(steps)}", gradients, advice)

    optimizer.register_step_pre_hook(check)


# ----------------------------------------------------- FSDP1 (fsdp1_mnist.py, t5_fsdp_finetune.py)
def strategy_to_use(strategy):
    """The sharding strategy (its name) to give FSDP1: NO_SHARD where it has nothing to shard
    with, said on rank 0. FSDP1 would switch a world size of 1 to NO_SHARD itself, with a warning;
    and HYBRID_SHARD on nodes of one process each would reduce within each node only: each node
    would train on its own."""
    world_size, local_world_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    alone = world_size == 1 or (local_world_size == 1 and strategy == "HYBRID_SHARD")
    if strategy == "NO_SHARD" or not alone:
        return strategy
    rank0_print(f"{strategy} with one process{' per node' * (world_size > 1)}: NO_SHARD")
    return "NO_SHARD"


def full_state_bytes(model):
    """The bytes of an FSDP1 model's full state dict: each unit's unsharded size (FSDP1's private
    _flat_param holds it; no public call gives it) in its parameters' dtype."""
    return sum(unit._flat_param._unpadded_unsharded_size.numel() * unit._flat_param.element_size()
               for unit in FSDP.fsdp_modules(model) if unit._flat_param is not None)


def offload_to_cpu(model):
    """Whether a full state dict's gather offloads the tensors to the CPU (only rank 0's).

    Workaround: a CPU run's tensors are in host memory already, and offloading them there breaks
    the gather in torch 2.11 ("setStorage: ... storage of size 0"; fine in 2.14): there every rank
    gets them. Remove it (always True) once requirements.txt asks for torch >= 2.14."""
    return next(model.parameters()).device.type != "cpu"


# -------------------------------------------------------------------------------- the run's report
class Report:
    """Times the run (on a GPU with CUDA events too), measures memory per rank, prints both and
    writes --metrics-json: the figures of every script, plus the script's own (write())."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.cuda = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self.cuda = self.cuda if device.type == "cuda" else None
        self.restart()

    def restart(self):
        """Time the run from now on (what came before, such as loading, left out)."""
        self.start, self.laps = time.perf_counter(), []
        if self.cuda:
            self.cuda[0].record()

    def lap(self):
        """Seconds since the previous lap, or since the start; self.laps keeps them all."""
        self.laps.append(time.perf_counter() - self.start - sum(self.laps))
        return self.laps[-1]

    def memory(self, model, optimizer=None):
        """(train state, peak) bytes, the maximum over ranks: parameters + gradients + optimizer
        state (shards under FSDP, replicas under DDP); CUDA max allocated, or the peak RSS."""
        tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
        for state in optimizer.state.values() if optimizer else ():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
        tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensors
        peak = (torch.cuda.max_memory_allocated(self.device) if self.cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
        figures = torch.tensor([sum(t.numel() * t.element_size() for t in tensors), peak],
                               dtype=torch.float64, device=self.device)
        ranks = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, figures)
        self.peaks = [int(rank[1]) for rank in ranks]  # per rank, for --metrics-json
        return int(max(rank[0] for rank in ranks)), max(self.peaks)

    def training_done(self, model, optimizer, trained=True):
        """Print the training time (not when nothing was left to train) and the memory figures."""
        self.wall_s = time.perf_counter() - self.start
        if trained and self.cuda:
            self.cuda[1].record()
            self.cuda[1].synchronize()
            seconds = self.cuda[0].elapsed_time(self.cuda[1]) / 1000
            rank0_print(f"CUDA event elapsed time: {seconds:.3f}sec")
        elif trained:
            rank0_print(f"Wall-clock elapsed time: {self.wall_s:.3f}sec")
        self.state, self.peak = self.memory(model, optimizer)
        rank0_print(f"Peak memory per rank ({'CUDA allocated' if self.cuda else 'process RSS'}): "
                    f"{self.peak / 2**20:.1f} MiB; parameters + gradients + optimizer state: "
                    f"{self.state / 2**20:.3f} MiB")

    def write(self, **metrics):
        """Rank 0 writes --metrics-json, under a temporary name first: never half-written."""
        if self.args.metrics_json and dist.get_rank() == 0:
            metrics = {"script": RUN["script"], "world_size": dist.get_world_size(),
                       "device": self.device.type, "backend": dist.get_backend(), "wall_s":
                       self.wall_s, "train_state_bytes": self.state, "peak_memory_bytes":
                       self.peak, "peak_memory_per_rank": self.peaks, **metrics}
            with open(f"{self.args.metrics_json}.tmp", "w") as f:
                json.dump(metrics, f, indent=2)
            os.replace(f"{self.args.metrics_json}.tmp", self.args.metrics_json)


# ------------------------------------------------------------------------------------------- flags
def add_run_flags(parser):
    """The flags of every script about how it runs; returns their group, for the script's own."""
    add = parser.add_argument_group("run").add_argument
    add("--cpu", "--no-cuda", action="store_true", help="CPU and gloo even if there are GPUs")
    add("--world-size", type=positive(int), metavar="N", help="processes to start without "
        "torchrun (None: one per GPU, or 2 on CPU)")
    add("--dist-timeout", type=positive(float), default=600, metavar="S", help="seconds to wait "
        "for a lost or hung peer before the job fails (longer than any save or download)")
    add("--metrics-json", metavar="PATH", help="write the final metrics to PATH (rank 0)")
    add("--return-freed-memory", action="store_true", help="on CPU, give freed blocks of 256 KiB "
        "or more back to the system at once (glibc keeps them for reuse): at t5-base's shape "
        "with LoRA, about half the memory a rank gains while training, at 1.3x the time")
    return add


class RankZeroArgumentParser(argparse.ArgumentParser):
    """The flags' parser: a bad value is said once, from rank 0, not once per torchrun worker;
    --help gives each flag's default where it says something (HelpWithDefaults)."""

    def __init__(self, description):
        super().__init__(description=description, formatter_class=HelpWithDefaults)

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:
            super().error(message)
        fail(message)


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """"(default: X)" after a flag's help, but not after a switch (off unless given), a default of
    None (its help says what happens then) or help that names its default itself."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive(kind, zero=False, most=math.inf):
    """An argparse type: a finite number of that kind (int or float), above 0 (with zero: 0 or
    more) and at most `most`; so never NaN."""
    def parse(text):
        value = kind(text)
        if not ((value >= 0 if zero else value > 0) and math.isfinite(value) and value <= most):
            rule = "a positive integer" if kind is int else "a positive number"
            if zero:
                rule = "an integer" if kind is int else "a number"
                rule += " from 0" if most < math.inf else " of 0 or more"
            if most < math.inf:
                shown = f"{most:,}" if kind is int else f"{most:g}"
                rule += f" to {shown}" if zero else f" of at most {shown}"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # for argparse's "invalid int value: 'x'"
    return parse


def aligned(header, rows):
    """The table's lines: cells " | "-separated, each column as wide as its widest cell, so that
    figures stay under their heading whatever their size (the last column, words, is not padded;
    a row of two cells is a remark about its first)."""
    widths = [max(len(row[i]) for row in (header, *rows) if len(row) > i + 1)
              for i in range(len(header) - 1)]
    return [" | ".join([*(cell.rjust(width) for cell, width in zip(row[:-1], widths)), row[-1]])
            for row in (header, *rows)]


# ---------------------------------------------- --plan (fsdp2_transformer.py, t5_fsdp_finetune.py)
PLAN_RANKS = (1, 2, 4, 8, 16, 32, 64)  # the world sizes a plan compares


def add_plan_flags(parser, details):
    """--plan and --plan-device-memory; details: what the script's planner reads and leaves out."""
    add = parser.add_argument_group("plan: will it fit? (no training)").add_argument
    add("--plan", action="store_true", help="print each rank's predicted memory for these flags "
        "(training state, gathered FSDP units, activations, logits) at --world-size and for "
        "1-64 ranks, whether it fits --plan-device-memory, and the cheapest flags that would "
        f"make it fit; then exit without training. {details}")
    add("--plan-device-memory", type=positive(float), metavar="GiB", help="one device's memory "
        "for --plan (default: the visible GPU's, else 80)")


def plan_sizes(args):
    """(world size, processes per node, one device's GiB) that --plan plans for: those of the
    launch these flags make (under torchrun, its own), and the visible GPU's memory."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size or (
        torch.cuda.device_count() if use_cuda else 0) or 2))
    device_gib = args.plan_device_memory or (
        torch.cuda.get_device_properties(0).total_memory / 2**30 if use_cuda else 80)
    return world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), device_gib


def print_plan(text, plan, metrics_json, script):
    """Rank 0 prints the plan's text and writes the plan to metrics_json; then exit 0."""
    rank0_print(text)
    if metrics_json and int(os.environ.get("RANK", "0")) == 0:
        with open(f"{metrics_json}.tmp", "w") as f:
            json.dump({"script": script, "plan": plan}, f, indent=2)
        os.replace(f"{metrics_json}.tmp", metrics_json)
    sys.exit(0)


# ---------------------------------------------------- MNIST's files (fsdp1_mnist.py, ddp_mnist.py)
MNIST_FILES = [f"{split}-{kind}-ubyte" for split in ("train", "t10k")
               for kind in ("images-idx3", "labels-idx1")]


def checked_mnist(data_dir, load):
    """load(data_dir), MNIST's (train, test) sets, on each node's local rank 0 first (which
    downloads missing files once per node), then on the node's other ranks. A failed download,
    a file torchvision cannot read, or contents that cannot be trained on stop every rank with
    one line saying what to do; a failed download leaves no empty folders behind."""
    raw_dir = os.path.join(os.path.abspath(data_dir), "MNIST", "raw")

    def load_and_check():
        missing = not all(os.path.exists(os.path.join(raw_dir, name)) for name in MNIST_FILES)
        made = [d for d in (os.path.abspath(data_dir), os.path.dirname(raw_dir), raw_dir)
                if not os.path.exists(d)]
        try:  # torchvision downloads only missing files
            sets = load(data_dir)
        except Exception as e:
            if missing:  # a failed download leaves no empty folders behind
                for folder in made[:1]:
                    shutil.rmtree(folder, ignore_errors=True)
                raise ValueError(  # the last line of torchvision's message says why
                    f"MNIST is not in {raw_dir} and downloading it failed ("
                    f"{str(e).strip().splitlines()[-1]}). On a machine with network, python -c "
                    "\"from torchvision.datasets import MNIST; MNIST('data', download=True)\" "
                    "downloads it into data/MNIST: copy that into "
                    f"{os.path.abspath(data_dir)} or pass --data-dir data; or, offline, python "
                    f"tests/digits_mnist.py {data_dir} (in this repository) writes MNIST-format "
                    "files there from scikit-learn's digits.")
            problems = [idx_problem(os.path.join(raw_dir, name)) for name in MNIST_FILES]
            raise ValueError(f"cannot read MNIST from {raw_dir} ("  # torchvision names no file
                             f"{next(filter(None, problems), None) or repr(e)}); delete that "
                             "folder to download it again.")
        for dataset in sets:  # the files' headers were fine; do their contents agree?
            problem = mnist_problem(dataset)
            if problem:
                raise ValueError(f"cannot use MNIST from {raw_dir} ({problem}); delete that "
                                 "folder to download it again.")
        return sets

    return local_rank_zero_first(load_and_check)


def mnist_problem(dataset):
    """Why a loaded MNIST split cannot be trained on (image and label counts, sizes, labels)."""
    images, labels, split = dataset.data, dataset.targets, "train" if dataset.train else "t10k"
    if len(images) != len(labels):
        return f"{split} has {len(images)} images but {len(labels)} labels"
    if tuple(images.shape[1:]) != (28, 28):
        return f"{split}'s images are {'x'.join(map(str, images.shape[1:]))} pixels, not 28x28"
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) <= 9:
        return f"{split} has labels outside 0-9 (from {int(labels.min())} to {int(labels.max())})"
    return None


def idx_problem(path):
    """Why path is not a complete IDX file (MNIST's format), or None."""
    with open(path, "rb") as f:  # it exists: torchvision would have downloaded it otherwise
        data = f.read()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        return f"{os.path.basename(path)} does not start with an IDX header"
    size = 4 + 4 * data[3] + math.prod(int.from_bytes(data[i:i + 4], "big")
                                       for i in range(4, 4 + 4 * data[3], 4))
    if len(data) != size:
        return f"{os.path.basename(path)} has {len(data)} bytes, its header says {size}: truncated?"
