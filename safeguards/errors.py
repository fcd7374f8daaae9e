"""One error line instead of a traceback per rank: a failing rank says why, the ranks agree on
the first problem any of them found, and a diverged run stops before it saves what it became."""
import contextlib
import datetime
import multiprocessing
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_pre_hook

FAILING = []  # this process is ending with an error line of its own (or a peer's)
PROGRESS = {"at": ""}  # where training is (" at step 40"), for the line of an interrupted run


def rank0_print(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fail(message, node_local=False):
    """Exit 1 with one error line: rank 0 (node_local: each node's local rank 0) says it at once;
    another rank after 10 s, which it lives to see only when the problem is its own alone."""
    FAILING.append(message)  # the launcher's SIGTERM that may follow is not an interruption
    if int(os.environ.get("LOCAL_RANK" if node_local else "RANK", "0")) != 0:
        time.sleep(10)
        message = f"rank {os.environ['RANK']}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def end_child_processes():
    """Before os._exit, which skips their shutdown: kill what this process started (DCP's writer,
    which would print an EOFError traceback once its parent is gone; DataLoader workers)."""
    for child in multiprocessing.active_children():
        child.kill()


def agree_on_error(error):
    """Fail on every rank if any rank found an error (a message), so that none waits for ever."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        fail(next(e for e in errors if e))


def one_line(error):
    """An exception as one line: its type and the first sentence of its message's last line (where
    torch, DCP and transformers put the reason)."""
    error = root_cause(error)
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[-1].split()).split(". ")[0].rstrip(".")[:200] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def root_cause(error):
    """The exception behind a DCP CheckpointException (which holds each failed rank's exception
    with its traceback), or the error itself."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if failures else error


@contextlib.contextmanager
def in_one_line(what, advice, every_rank=False):
    """An exception in the block becomes one line, '<what> (<its reason>); <advice>': a ValueError
    raised, or, with every_rank (all ranks run the block), a fail() on every rank if any failed."""
    error = None
    try:
        yield
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        error = f"{what} ({one_line(e)}); {advice}"
        if not every_rank:
            raise ValueError(error) from None
    if every_rank:
        agree_on_error(error)


def diverged(what, advice):
    """The line of a run that diverged: what is not finite, and what to try."""
    return f"training diverged: {what}; {advice}"


def not_finite(tensors):
    """How many of the tensors (a DTensor: its local shard) hold a NaN or an infinity, as a
    tensor on their device: reading it waits for them."""
    bad = torch.zeros((), device=tensors[0].device if tensors else "cpu")
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        bad += (~torch.isfinite(tensor.detach())).any()
    return bad


def stop_if_diverged(where, tensors, advice):
    """Fail on every rank, in one line, if any of the tensors (a loss, or a model's parameters) is
    NaN or infinite on any rank: a diverged run must not go on, nor save what it has become."""
    bad = not_finite(tensors)
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only (CPU offload, a float loss)
        bad = bad.cuda()
    dist.all_reduce(bad)
    if bad:
        fail(diverged(f"{where} is not finite (NaN or infinite)", advice))


def stop_on_non_finite_gradients(optimizer, advice):
    """From now on, before each optimizer step, check that every gradient is finite on every rank,
    else stop every rank in one line before the update carries NaN into the weights. Through the
    optimizer's step hook, so that the training loop stays plain (under a grad scaler, steps with
    inf gradients are skipped before the hook)."""
    parameters, steps = [p for group in optimizer.param_groups for p in group["params"]], []

    def check(optimizer, positional, keywords):
        steps.append(None)  # this one
        gradients = [p.grad for p in parameters if p.grad is not None]
        stop_if_diverged(f"a gradient of optimizer step {len(steps)}", gradients, advice)

    optimizer.register_step_pre_hook(check)


class LockStep:
    """Ranks that run different numbers of batches, or of forwards in a batch, fail in one line
    instead of waiting in FSDP's next collective until --dist-timeout. They check in with each
    other (an all-gather of 4 numbers over a gloo group of their own, on the host) before each
    batch of a loop, when it runs out, and, given the model, before each forward and optimizer
    step (benchmarks/README.md, "Lock-step check")."""

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
