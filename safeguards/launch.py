"""Starting a script's processes and its process group, however the job was started, and ending
it in one line where it fails: bad input, memory, a lost peer (--dist-timeout), Ctrl-C or SIGTERM
(where a rerun resumes).

    python SCRIPT.py                     spawns one process per GPU (or --world-size, 2 on CPU)
    torchrun ... SCRIPT.py               runs in each worker torchrun started
    srun python SCRIPT.py                one job of SLURM's tasks (slurm_environment)
    Ray Train, Kubeflow (PET_*)          joins the process group the framework made / torchrun's
"""
import contextlib
import ctypes
import datetime
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

from .errors import FAILING, PROGRESS, agree_on_error, end_child_processes, fail, one_line
from .report import RUN
from .workarounds import end_cleanly


def launch(main, args, *, resume_hint, memory_advice, check=None):
    """Run main(args, device) on every rank: in this process under torchrun or srun; started with
    python, in --world-size processes it spawns (one per GPU, or 2 on CPU), once check(args,
    device, world_size) found nothing. resume_hint(), or a text: where a rerun resumes, said when
    a signal stops the run; memory_advice: what the line of an out-of-memory error advises."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    launcher, ending = "torchrun", (resume_hint, memory_advice)
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
        return run_worker(main, args, use_cuda, ending)
    gpus = torch.cuda.device_count() if use_cuda else 0
    world_size = args.world_size or gpus or 2
    if world_size > gpus > 0:
        fail(f"--world-size {world_size} asks for more GPUs than the {gpus} present")
    if check and (problem := check(args, torch.device("cuda:0" if use_cuda else "cpu"),
                                   world_size)):
        fail(problem)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = mp.spawn(spawn_worker, args=(main, args, use_cuda, world_size, port, ending),
                       nprocs=world_size, join=False).processes
    signalled = forward_signals(lambda: [w.pid for w in workers if w.exitcode is None])
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


def forward_signals(running):
    """Pass Ctrl-C or SIGTERM on to the processes whose pids running() gives; returns the list of
    when it came."""
    signalled = []

    def pass_on(signum, frame):
        signalled.append(time.monotonic())
        for pid in running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, pass_on)
    return signalled


def spawn_worker(rank, main, args, use_cuda, world_size, port, ending):
    # What torchrun would set, so that both ways to launch run the same code.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    share_the_cores(world_size)
    # A process group of its own, with the processes it starts (DCP's checkpoint writer), as
    # torchrun gives each worker: launch stops them all at once (killpg).
    os.setpgid(0, 0)
    # mp.spawn makes "spawn" this process's start method, where torchrun's worker has Python's
    # default: with "spawn", the semaphores libraries make (tqdm's lock) are registered for
    # cleanup, and an exit through os._exit (an error line, Ctrl-C) reports them as leaked.
    multiprocessing.set_start_method(None, force=True)
    try:
        run_worker(main, args, use_cuda, ending)
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
def run_worker(main, args, use_cuda, ending):
    """main(args, device) in this process's process group (or the one Ray Train made); a lost
    peer, memory or Ctrl-C ends it in one line."""
    resume_hint, memory_advice = ending
    made_here = not dist.is_initialized()
    if threading.current_thread() is threading.main_thread():  # not in Ray's: its signals
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: stop_on_signal(signum, resume_hint))
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
    try:  # a collective that waits longer than --dist-timeout for a peer fails, not hangs
        if made_here:
            init_process_group("nccl" if use_cuda else "gloo",
                               datetime.timedelta(seconds=args.dist_timeout),
                               device if use_cuda else None)
        RUN["script"] = os.path.basename(main.__code__.co_filename)  # for the report
        main(args, device)  # its model and optimizer are garbage once it returns
    except (torch.OutOfMemoryError, MemoryError) as e:
        fail(f"out of memory ({one_line(e).split(': ', 1)[-1]}): {memory_advice}")
    except RuntimeError as e:
        reason = re.search(r"can't allocate memory[^.]*", str(e))  # a failed CPU allocation
        if reason:
            fail(f"out of memory ({reason[0]}): {memory_advice}")
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
        end_cleanly(made_here)


def return_freed_memory():
    """--return-freed-memory, on CPU: glibc hands freed blocks of 256 KiB or more back at once
    (by default its threshold rises to 32 MiB, and FSDP's freed buffers stay with the process), at
    the price of mapping each afresh (benchmarks/README.md, 'Memory returned on CPU')."""
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


def stop_on_signal(signum, resume_hint):
    """Ctrl-C or SIGTERM: exit at once, status 130 (143), with one line from rank 0 saying where a
    rerun resumes, no traceback; silent when this process is already ending with an error."""
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)  # the launcher passes the signal on: once is enough
    if int(os.environ.get("RANK", "0")) == 0 and not FAILING:
        hint = resume_hint if isinstance(resume_hint, str) else resume_hint()
        line = f"interrupted by {signal.Signals(signum).name}{PROGRESS['at']}; {hint}\n"
        os.write(sys.stderr.fileno(), line.encode())  # not print: safe wherever Python stopped
    sys.stdout.flush()
    end_child_processes()
    os._exit(128 + signum)


def local_rank_zero_first(load):
    """load() on each node's local rank 0, then on the others (downloads and caches written once
    per node); a ValueError on any rank stops every rank with its text."""
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
