"""The safeguards around fsdp2_transformer.py's checkpointers (SafeSaves): the folder locked, a
resume only from a checkpoint that fits, no save of a diverged model or beyond the free space, a
failure on any rank in one line, and asynchronous saves waited for with the ranks in step."""
import contextlib
import multiprocessing.resource_tracker
import os
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .checkpoints import (
    Folder,
    loaded_state_problem,
    lock_folder,
    marker_problem,
    saving,
    write_problem,
)
from .errors import (
    agree_on_error,
    diverged,
    fail,
    in_one_line,
    not_finite,
    one_line,
    rank0_print,
    stop_if_diverged,
)
from .report import nbytes, tensors_in
from .workarounds import STAGER_REUSABLE, copy_into_buffers

ELSEWHERE = "pass another --checkpoint-dir"  # where else a save can go, when a disk is full
# What --metrics-json says of the checkpoints when none is saved
NO_CHECKPOINTS = {"checkpoint": None, "checkpoint_stall_s": [], "checkpoint_wait_s": [],
                  "checkpoint_staging_bytes": None, "checkpoint_staging_s": None}


def fsdp2_folder(checkpoint_dir, marker):
    """--checkpoint-dir's checkpoints (marker: the file written last into each)."""
    return Folder(os.path.abspath(checkpoint_dir), "--checkpoint-dir", "step_", marker, "step", 0,
                  "run the same command to resume")


def resume_hint(checkpoint_dir, marker):
    """What says where a rerun resumes (when Ctrl-C or SIGTERM stops the run): a text, or the
    function that finds it then."""
    if not checkpoint_dir:
        return "no --checkpoint-dir: a rerun starts from step 0"
    return fsdp2_folder(checkpoint_dir, marker).rerun_resumes


def checkpoint_figures(saves):
    """What --metrics-json says of a run's saves (saves: its SafeSaves, or None)."""
    return saves.figures() if saves else NO_CHECKPOINTS


class SafeSaves:
    """The safeguards of one run's checkpointer, whose attributes it reads and never changes.
    It locks the folder, and where this run starts afresh (fresh) refuses an earlier run's
    checkpoints unless overwrite deletes them. pauses: the seconds each save blocked training;
    waits: the part of them spent waiting for the previous save's background write."""

    def __init__(self, checkpointer, model, optimizer, *, marker, fresh, overwrite, advice):
        self.checkpointer, self.model, self.optimizer = checkpointer, model, optimizer
        self.fresh, self.advice = fresh, advice
        self.background = hasattr(checkpointer, "stager")
        self.folder = fsdp2_folder(checkpointer.folder, marker)
        self.pauses, self.waits, self.last, self.path, self.doing = [], [], None, None, None
        lock_folder("--checkpoint-dir", self.folder.path)
        if fresh and not overwrite:
            agree_on_error(self.folder.earlier_run_problem("drop --no-resume"))
        elif fresh:
            self.folder.overwrite()
        if self.background:
            self.start_writers()
            # Ahead of the checkpointer's own hook (registered at its first save)
            optimizer.register_step_pre_hook(self.wait_for_copy)

    def resumable(self):
        """The newest complete checkpoint whose marker fits this model, or None."""
        path = None if self.fresh else self.folder.resumable()
        if path:
            agree_on_error(marker_problem(path, self.folder.marker, self.checkpointer.config)
                           if dist.get_rank() == 0 else None)
        return path

    @contextlib.contextmanager
    def reading(self, path):
        """Around the resume from path: a failed read, or a state that does not fit the model,
        on any rank stops every rank in one line."""
        with in_one_line(f"cannot read checkpoint {path}", "delete it to resume from the "
                         "checkpoint before it, or pass --no-resume", every_rank=True):
            yield
        agree_on_error(loaded_state_problem(self.model, self.optimizer, path))

    @contextlib.contextmanager
    def saving(self, step):
        """Around the save of step: the previous background write waited for, no diverged model
        (a background save checks with its copy), the free space checked, a failed write in one
        line (its .tmp removed), SIGINT blocked for what the save starts; its pause timed."""
        started = time.perf_counter()
        self.wait_for_writes()
        self.waits.append(time.perf_counter() - started)
        if self.waits[-1] > 0.5:  # an asynchronous save's pause is then the disk's, not the copy's
            rank0_print(f"Waited {self.waits[-1]:.2f} s for the previous checkpoint's background "
                        "write: it takes longer than --save-every steps of training; save less "
                        "often, or to a faster disk")
        ahead = getattr(self.checkpointer, "ahead", None)  # the first save copies into its memory
        self.wait_in_step([ahead] if ahead is not None else [])
        if not self.background:
            stop_if_diverged("a parameter", list(self.model.parameters()), self.advice)
        self.path = os.path.join(self.folder.path, f"step_{step:06d}")
        self.doing = f"write checkpoint {self.path}"
        full = self.checkpointer.format == "full"
        state = [list(self.model.parameters()), list(self.optimizer.state.values())]
        with saving([self.path], nbytes(tensors_in(state, local=not full)),
                    f"{ELSEWHERE}; {self.folder.rerun_resumes()}", sharded=not full):
            with ctrl_c_for_training_only():
                yield
        self.pauses.append(time.perf_counter() - started)
        if not self.background:
            self.last = self.path
            self.said_pause()

    def said_pause(self):
        rank0_print(f"Checkpoint {os.path.basename(self.path)}: training paused "
                    f"{self.pauses[-1]:.2f} s")

    def wait_for_copy(self, *hook_args):
        """The optimizer's step pre-hook (hook_args): after an asynchronous save, wait for its copy
        to host memory (a pause of the save's); a copy that failed on any rank stops every rank."""
        staging = getattr(self.checkpointer, "staging", None)
        if staging is None:
            return
        started, error = time.perf_counter(), None
        try:
            staging.result()
        except Exception as e:
            error = self.failure(e, f"cannot copy checkpoint {self.path} to host memory")
        errors = [None] * dist.get_world_size()  # a rank's copy may fail alone
        dist.all_gather_object(errors, error)
        if any(errors):
            self.stop(next(error for error in errors if error))
        if hook_args:
            self.pauses[-1] += time.perf_counter() - started
        self.said_pause()

    def failure(self, error, doing):
        """The line of a background copy or write that failed."""
        if isinstance(error, NonFinite):
            return diverged(str(error), self.advice)
        return write_problem(error, self.path, ELSEWHERE) or f"{doing} ({one_line(error)})"

    def wait_for_writes(self):
        """Wait in step for the previous asynchronous save's write: it is then complete."""
        pending = getattr(self.checkpointer, "pending", None)
        if pending is not None:
            self.wait_in_step([pending])
            self.last = self.path

    def wait_in_step(self, futures):
        """Wait for futures, the ranks comparing every 0.1 s whether any failed (a writer that died
        leaves its peers waiting for ever); a failure stops every rank in one line."""
        while futures:
            finished, error = all(future.done() for future in futures), None
            for future in futures if finished else ():
                if error is None and future.exception() is not None:
                    error = self.failure(future.exception(), f"cannot {self.doing}")
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, (finished, error))
            if any(error for _, error in states):
                self.stop(next(error for _, error in states if error))
            if all(finished for finished, _ in states):
                break
            time.sleep(0.1)

    def stop(self, error):
        """Stop every rank in one line; rank 0 removes the failed save's .tmp folder."""
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp", ignore_errors=True)
        fail(f"{error}; {self.folder.rerun_resumes()}")

    def start_writers(self):
        """Start DCP's writer processes before training, not in its first save's pause: a save of
        one number to a throwaway folder, the ranks in step; a failed start ends in one line."""
        # multiprocessing unblocks SIGINT in the thread that starts its resource tracker (Python
        # 3.11's ensure_running), which the writer's start would otherwise do inside
        # ctrl_c_for_training_only: started here, first.
        multiprocessing.resource_tracker.ensure_running()
        self.path = os.path.join(self.folder.path, "writers")  # its .tmp is removed if it fails
        self.doing = "start the checkpoint writer processes"
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp", ignore_errors=True)  # the leftover of a crash
        dist.barrier()
        with ctrl_c_for_training_only():
            started = dcp.async_save({"start": torch.zeros(1)}, checkpoint_id=f"{self.path}.tmp",
                                     process_group=self.checkpointer.group,
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            self.wait_in_step([started])  # rank 0's ends last: after every rank's writer wrote
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp")

    @contextlib.contextmanager
    def finishing(self):
        """Around the wait for the last save: the ranks in step, as wait_in_step."""
        self.wait_for_copy()
        self.wait_for_writes()
        yield

    def figures(self):
        """What --metrics-json says of the saves; asynchronous: each copy's new shared memory,
        seconds and tensors in newly allocated host memory, stage_ahead's apart."""
        figures = {**NO_CHECKPOINTS, "checkpoint": self.last, "checkpoint_stall_s": self.pauses,
                   "checkpoint_wait_s": self.waits}
        if not self.background:
            return figures
        stager, ahead = self.checkpointer.stager, int(self.checkpointer.stager.ahead)
        copies = [dict(zip(("bytes", "s", "new_tensors"), copy)) for copy in zip(
            stager.grown, stager.seconds, stager.new_tensors)]
        return {**figures, "checkpoint_staging_bytes": stager.grown[ahead:],
                "checkpoint_staging_s": stager.seconds[ahead:],
                "checkpoint_staging_new_tensors": stager.new_tensors[ahead:],
                "checkpoint_staged_ahead": copies[0] if ahead and copies else None}


@contextlib.contextmanager
def ctrl_c_for_training_only():
    """SIGINT blocked for the threads started inside and the writer processes they start: a
    Ctrl-C reaches the training process (one line), never a writer (a traceback per rank)."""
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def shared_memory_bytes():
    """The bytes of shared memory this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))
    except (OSError, StopIteration):
        return 0


class NonFinite(ValueError):
    """A save's state holds a NaN or infinite parameter."""


class FiniteStager(AsyncStager):
    """An AsyncCheckpointer's stager that first checks, in a thread (on a GPU a stream) of its own,
    off training's path, that no parameter is NaN or infinite: a diverged model is never saved.
    ahead: the first copy is stage_ahead's. It counts each copy's seconds and memory."""
    _synchronize_after_execute = False  # stage() returns a future

    def __init__(self, stager, ahead=True):
        self.stager, self.ahead = stager, ahead
        self.checking = ThreadPoolExecutor(max_workers=1)
        self.seconds, self.grown, self.new_tensors = [], [], []
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.buffers = None  # torch < 2.13: the host memory every copy goes to (STAGER_REUSABLE)
        self.first_copy, self.first_addresses = None, set()

    def stage(self, state_dict):
        return self.checking.submit(self.check_then_stage, state_dict)

    def check_then_stage(self, state_dict):
        # The parameters stay as they are until the next optimizer step, which waits for this.
        started, shared = time.perf_counter(), shared_memory_bytes()
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            if not_finite(list(tensors_in(state_dict["model"]))):
                raise NonFinite("a parameter is not finite (NaN or infinite)")
        if STAGER_REUSABLE:
            staged = self.stager.stage(state_dict)
            staged = staged.result() if isinstance(staged, Future) else staged
        else:
            self.buffers, staged = copy_into_buffers(state_dict, self.buffers, self.stream)
        self.seconds.append(time.perf_counter() - started)
        self.grown.append(shared_memory_bytes() - shared)
        addresses = {tensor.data_ptr() for tensor in tensors_in(staged)}
        self.new_tensors.append(len(addresses - self.first_addresses))
        if self.first_copy is None:
            self.first_copy, self.first_addresses = staged, addresses
        if self.ahead and len(self.seconds) == 1:
            rank0_print(f"Staged ahead: {self.grown[0] / 2**20:,.1f} MiB of shared host memory "
                        + ("(pinned) " if self.stream else "") + "for the checkpoints' copies, "
                        f"allocated and filled in {self.seconds[0]:.2f} s beside training (rank "
                        "0's); every save copies into it")
        return staged

    def close(self):
        self.checking.shutdown()
        self.stager.close()
