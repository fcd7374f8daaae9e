"""torchft's replica groups (fsdp2_transformer.py --fault-tolerance), around the lesson's
fault_tolerant(): the flags and their checks, a store per group, a first quorum that holds every
group, torchft's failures in one line each, and the launcher that starts the groups when the
script is started with python."""
import datetime
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from .errors import fail, one_line, rank0_print
from .launch import forward_signals
from .workarounds import quiet_torchft

TORCHFT = "torchft==0.2.0"  # the version tests/test_fault_tolerance.py passes with


def import_torchft():
    """torchft, quiet (quiet_torchft); an ImportError where it is not installed."""
    os.environ.setdefault("RUST_LOG", "warn")  # before its import: its servers' INFO lines
    import torchft
    import torchft.coordination

    quiet_torchft()
    return torchft


def torchft_problem():
    """Why torchft cannot be imported (how to install it), or None."""
    try:
        import_torchft()
    except ImportError as e:
        return f"--fault-tolerance needs torchft ({e}): pip install {TORCHFT}"
    return None


def fault_tolerance_problem(args, world_size):
    """Why these flags cannot run fault tolerant here, or None."""
    if not args.fault_tolerance:
        if args.replica_group is not None:
            return "--replica-group names a replica group of --fault-tolerance; add it"
        return None
    if problem := torchft_problem():
        return problem
    for flag, given in (("--replicate-degree", args.replicate_degree > 1),
                        ("--tp-degree", args.tp_degree > 1),
                        ("--pack-documents", args.pack_documents)):
        if given:
            return (f"{flag} with --fault-tolerance is not supported here (each replica group "
                    "shards over its ranks with FSDP2 only, rows of equal weight); drop one")
    if args.replica_group is None:
        return ("--fault-tolerance under torchrun or srun runs one replica group: say which with "
                f"--replica-group 0 to {args.replica_groups - 1} (started with python, it starts "
                "them all)")
    if args.replica_group >= args.replica_groups:
        return (f"--replica-group {args.replica_group} is not one of --replica-groups "
                f"{args.replica_groups} (0 to {args.replica_groups - 1})")
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        return ("--fault-tolerance under torchrun or srun joins a Lighthouse: start one "
                "(torchft_lighthouse --min_replicas 1) and set "
                "TORCHFT_LIGHTHOUSE=http://HOST:29510")
    if args.batch_size % (args.replica_groups * world_size):
        return (f"--batch-size {args.batch_size} does not split into --replica-groups "
                f"{args.replica_groups} x {world_size} ranks; use a multiple of "
                f"{args.replica_groups * world_size}")
    return None


class ReplicaGroups:
    """The safeguards around the lesson's fault_tolerant() for this replica group (group of
    groups): a store of its own, a first quorum of every group, a lost Lighthouse in one line."""

    def __init__(self, groups, group, timeout_s):
        self.groups, self.group, self.timeout_s = groups, group, timeout_s
        self.short_since = None  # the first step trained on fewer groups, while it lasts
        logging.getLogger("torchft.manager").addFilter(OneLinePerEvent(group))
        # torchft's ProcessGroupNCCL warns where this is unset, and sets it to its own timeout
        # (the lesson's: --dist-timeout); in whole seconds; a user's value is kept.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(math.ceil(timeout_s)))

    def store(self):
        """The (host, port) of a TCPStore for this group's torchft Manager, served by its rank 0
        for this attempt. Workaround: the Manager (torchft 0.2.0) publishes its server's address
        under a fixed key of the store it is given; torchrun's store outlives a --max-restarts
        restart, so the other ranks of a restarted group could read the dead server's address.
        Remove when the Manager takes a store prefix."""
        where = [None, None]
        if dist.get_rank() == 0:
            GROUP_STORE.append(dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False))
            where = [socket.gethostname(), GROUP_STORE[0].port]
        dist.broadcast_object_list(where)
        return where

    def started(self, optimizer):
        """Started with python, wait until every group's manager is up, so that the first quorum
        holds them all (rank 0's Manager asks the Lighthouse: only it waits). Returns optimizer
        (torchft's), whose zero_grad ends in one line where no quorum comes."""
        address = os.environ.get("FT_START_STORE")
        if (address is not None and dist.get_rank() == 0
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            if store.add("groups_started", 1) == self.groups:
                store.set("all_started", "yes")
            try:
                store.wait(["all_started"])
            except dist.DistStoreError:
                fail(f"replica group {self.group}: the other groups did not start within "
                     f"--dist-timeout {self.timeout_s:g}s; see their lines")
        zero_grad = optimizer.zero_grad

        def zero_grad_or_one_line(set_to_none=True):  # where torchft's step asks for a quorum
            try:
                zero_grad(set_to_none)
            except (TimeoutError, RuntimeError) as e:
                fail(f"replica group {self.group}: no quorum from the Lighthouse at "
                     f"{os.environ['TORCHFT_LIGHTHOUSE']} within 2 x --dist-timeout "
                     f"{self.timeout_s:g}s ({one_line(e)}): it stopped or cannot be reached. "
                     "Restart it and the groups: they resume from their newest checkpoint in "
                     "--checkpoint-dir")

        optimizer.zero_grad = zero_grad_or_one_line
        return optimizer

    def step(self, step, manager):
        """After a committed step: a line where steps begin to train on fewer replica groups (their
        rows skipped), where all are back, and where this group healed from a live one."""
        live, now = manager.num_participants(), manager.current_step()
        if now > step:
            rank0_print(f"step {now}: healed: received the model and optimizer state of step "
                        f"{now - 1} from a live replica group, and trained on")
        if live < self.groups and self.short_since is None:
            self.short_since = now
            rank0_print(f"step {now}: {live} of {self.groups} replica groups train: the rows of "
                        "the others are skipped until they are back (a global batch of "
                        f"{live}/{self.groups} of --batch-size)")
        elif live == self.groups and self.short_since is not None:
            rank0_print(f"step {now}: all {self.groups} replica groups train again (steps "
                        f"{self.short_since}-{now - 1} skipped the rows of those missing)")
            self.short_since = None


GROUP_STORE = []  # rank 0's TCPStore server: alive as long as the process


class OneLinePerEvent(logging.Filter):
    """torchft's failures as one line each, from rank 0 of the group: what failed, in which step,
    why, and what happens now. Workaround: torchft 0.2.0 logs each caught failure with its
    traceback at ERROR (the step is then retried). Remove when it logs one line."""

    EVENTS = {"waiting for work": "an all-reduce across replica groups failed",
              "in all reduce": "an all-reduce across replica groups failed",
              "in recovery": "receiving a live group's state failed",
              "in pg configure": "joining the replica groups' process group failed"}

    def __init__(self, group):
        super().__init__()
        self.group = group

    def filter(self, record):
        message = record.getMessage()
        event = next((e for key, e in self.EVENTS.items() if key in message), None)
        if event and dist.get_rank() == 0:
            step = re.search(r" - step (\d+)\]", message)
            reason = (one_line(record.exc_info[1]) if record.exc_info
                      else " ".join(message.split(": ", 1)[-1].split())[:160])
            print(f"replica group {self.group}: step {int(step[1]) + 1 if step else '?'} not "
                  f"committed: {event} ({reason}); it runs again with the groups alive",
                  file=sys.stderr, flush=True)
        return event is None and record.levelno >= logging.WARNING  # its INFO lines: none


def relay(pipe, out, prefix):
    """Each line of a replica group's output, with the group's name in front."""
    for line in iter(pipe.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def launch_replica_groups(script, argv, *, groups, world_size, cpu, min_replicas, restarts,
                          heartbeat_timeout_ms, grace_s, steps, checkpoint_dir, metrics_json):
    """--fault-tolerance started with python (argv: its flags): a Lighthouse in this process and a
    torchrun job per replica group of world_size ranks (each GPU in one group), which restarts the
    group up to `restarts` times when one of its ranks fails; group g saves into
    checkpoint_dir/group_g and writes its metrics to metrics_json's name + .group<g>. Ends when
    every group has: the status of the first that failed for good, else 0."""
    if problem := torchft_problem():
        fail(problem)
    torchft = import_torchft()
    gpus = torch.cuda.device_count() if not cpu else 0
    per_group = world_size or max(gpus // groups, 1)
    if gpus and per_group * groups > gpus:
        fail(f"--replica-groups {groups} x --world-size {per_group} asks for more GPUs than the "
             f"{gpus} present")
    lighthouse = torchft.coordination.LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
        heartbeat_timeout_ms=heartbeat_timeout_ms)
    rank0_print(f"Lighthouse at {lighthouse.address()}: {groups} replica groups of {per_group} "
                f"rank(s), each restarting itself up to {restarts} times")
    start = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    jobs, relays = [], []
    for group in range(groups):
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(),
                   FT_START_STORE=f"127.0.0.1:{start.port}")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(group * per_group + i) for i in range(per_group))
        own = ["--replica-group", str(group)]  # (the last of a repeated flag counts)
        if checkpoint_dir:  # each group's own checkpoints and metrics
            own += ["--checkpoint-dir", os.path.join(checkpoint_dir, f"group_{group}")]
        if metrics_json:
            root, ext = os.path.splitext(metrics_json)
            own += ["--metrics-json", f"{root}.group{group}{ext}"]
        jobs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={per_group}", f"--max-restarts={restarts}",
             os.path.abspath(script), *argv, *own],
            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for pipe, out in ((jobs[-1].stdout, sys.stdout), (jobs[-1].stderr, sys.stderr)):
            relays.append(threading.Thread(target=relay, args=(pipe, out, f"[group {group}] ")))
            relays[-1].start()

    forward_signals(lambda: [job.pid for job in jobs if job.poll() is None])
    # Done when every group has ended, or one has trained to --steps and the others did not follow
    # within --dist-timeout (their last steps): a group still restarting then would only train the
    # same steps again, alone.
    finished_at = None
    while any(process.poll() is None for process in jobs):
        finished = [g for g, process in enumerate(jobs) if process.poll() == 0]
        if finished and finished_at is None:
            finished_at = time.monotonic()
        late = finished and time.monotonic() - finished_at > grace_s
        for group, process in enumerate(jobs if late else []):
            if process.poll() is None:
                rank0_print(f"replica group {group} stopped: group {finished[0]} has trained to "
                            f"step {steps}")
                os.killpg(process.pid, signal.SIGKILL)  # its torchrun and workers
                process.wait()
        time.sleep(0.2)
    codes = [process.poll() if process.poll() != -signal.SIGKILL else 0 for process in jobs]
    for thread in relays:
        thread.join()
    lighthouse.shutdown()
    sys.exit(next((code for code in codes if code), 0))
