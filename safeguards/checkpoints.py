"""Checkpoint safety: writable outputs, a folder lock per job, an earlier run's checkpoints never
mixed with this run's, free space before a save, a failed write in one line, markers that fit the
model, and where a rerun resumes."""
import contextlib
import dataclasses
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import tempfile

import torch
import torch.distributed as dist

from .errors import agree_on_error, one_line, rank0_print, root_cause


def output_problem(folders, files):
    """Why a {flag: folder} (made if missing) or a {flag: file} cannot be written, or None: a bad
    path fails in seconds, not at the first save."""
    for flag, path in files.items():
        if path and os.path.isdir(path):
            return f"{flag}: {path} is a folder; pass a file's path"
        folders = {**folders, flag: os.path.dirname(os.path.abspath(path)) if path else None}
    for flag, folder in folders.items():
        try:
            if folder:
                os.makedirs(folder, exist_ok=True)
                tempfile.TemporaryFile(dir=folder).close()  # the one check that holds for root too
        except OSError as e:
            problem = "is a file" if os.path.isfile(folder) else f"is not writable ({e.strerror})"
            return f"{flag}: {folder} {problem}, so nothing can be written into it; pass another"
    return None


def check_outputs(metrics_json, folders, files=None):
    """Stop every rank unless rank 0 can write the folders, files and --metrics-json."""
    files = {**(files or {}), "--metrics-json": metrics_json}
    agree_on_error(output_problem(folders, files) if dist.get_rank() == 0 else None)


HELD_LOCKS = []  # the descriptors of the folders this process holds locked


def lock_problem(flag, folder):
    """Lock folder until this process ends, so that a second job (a double launch, a requeue)
    cannot write into it; the kernel frees a dead job's lock. Returns why it cannot, or None."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return (f"{flag} {folder} is in use by another job, which holds its lock; wait for it to "
                f"end, or pass another {flag}")
    HELD_LOCKS.append(descriptor)  # the lock lasts as long as the descriptor is open
    return None


def lock_folder(flag, folder):
    """Rank 0 locks folder for this job; another job's lock stops every rank."""
    agree_on_error(lock_problem(flag, folder) if dist.get_rank() == 0 else None)


def folder_number(path, prefix):
    """The N of a folder named <prefix>N (step_000050: 50), or None (step_000050.tmp: None)."""
    match = re.fullmatch(re.escape(prefix) + "([0-9]+)", os.path.basename(path))
    return int(match[1]) if match else None


def newest_complete(folder, prefix, marker):
    """The <prefix>N folder of the highest N that holds its marker file (written last), or None:
    a save cut short left a <prefix>N.tmp, or a folder without its marker."""
    complete = [path for path in glob.glob(os.path.join(glob.escape(folder), f"{prefix}*"))
                if folder_number(path, prefix) is not None
                and os.path.isfile(os.path.join(path, marker))]
    return max(complete, key=lambda path: folder_number(path, prefix), default=None)


@dataclasses.dataclass
class Folder:
    """A script's folder of checkpoints: its path, flag, the checkpoints' prefix and marker, what
    they count (step, epoch) from first, and how a rerun resumes."""
    path: str
    flag: str
    prefix: str
    marker: str
    unit: str
    first: int
    resume: str

    def rerun_resumes(self):
        """Which checkpoint a rerun resumes from."""
        newest = newest_complete(self.path, self.prefix, self.marker)
        if newest is None:
            return (f"no complete checkpoint in {self.flag} {self.path} yet: a rerun starts from "
                    f"{self.unit} {self.first}")
        return (f"the last complete checkpoint is {self.unit} "
                f"{folder_number(newest, self.prefix)} ({newest}): {self.resume}")

    def earlier(self):
        """The checkpoints (complete or not) an earlier run left in the folder."""
        return sorted(glob.glob(os.path.join(glob.escape(self.path), f"{self.prefix}*")))

    def earlier_run_problem(self, continue_it):
        """Why a run that starts afresh must not write into the folder (a later resume would mix
        the runs), or None; continue_it: how to continue the earlier run instead."""
        old = self.earlier()
        if not old:
            return None
        return (f"{self.flag} {self.path} holds checkpoints of an earlier run "
                f"({os.path.basename(old[-1])}...), which a later resume would mix with this "
                f"run's; {continue_it} to continue it, add --overwrite to delete them, or pass "
                f"another {self.flag}")

    def overwrite(self):
        """--overwrite: rank 0 deletes the earlier run's checkpoints, once every rank saw them."""
        old = self.earlier()
        dist.barrier()
        if old and dist.get_rank() == 0:
            for path in old:
                shutil.rmtree(path, ignore_errors=True)
            rank0_print(f"--overwrite: deleted {len(old)} checkpoint(s) of an earlier run")

    def resumable(self):
        """The newest complete checkpoint as rank 0 finds it, on every rank, or None."""
        found = [None]
        if dist.get_rank() == 0:
            for path in self.earlier():
                if folder_number(path, self.prefix) is not None and not os.path.exists(
                        os.path.join(path, self.marker)):
                    rank0_print(f"Ignoring incomplete checkpoint {path} (no {self.marker} marker)")
            found[0] = newest_complete(self.path, self.prefix, self.marker)
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            rank0_print(f"No complete checkpoint in {self.flag} {self.path}: starting from "
                        f"{self.unit} {self.first}")
        return found[0]


def marker_problem(path, marker, config):
    """Why this run (config: its model's sizes) cannot resume the checkpoint at path, read from
    its marker alone, or None."""
    redo = f"delete {path} to resume from the checkpoint before it, or pass --no-resume"
    try:
        with open(os.path.join(path, marker)) as f:
            saved = json.load(f)
        step = saved.get("step")
    except (OSError, ValueError, AttributeError) as e:
        return f"cannot read checkpoint file {os.path.join(path, marker)} ({one_line(e)}); {redo}"
    if step != folder_number(path, "step_") or not (isinstance(step, int) and step > 0):
        return (f"checkpoint {path}: its {marker} marker says step {step!r}, not its folder's; "
                f"{redo}")
    if saved.get("model") != config:
        flags = [" ".join(f"--{k.replace('_', '-')} {v}" for k, v in (sizes or {}).items())
                 for sizes in (saved.get("model"), config)]
        return (f"checkpoint {path} was written for another model ({flags[0]}) than this run's "
                f"({flags[1]}); pass its sizes, another --checkpoint-dir or --no-resume")
    return None


def loaded_state_problem(model, optimizer, path):
    """Why the optimizer state a resume loaded does not fit the parameters' shapes, or None."""
    for p in model.parameters():
        shape = p.to_local().shape if hasattr(p, "to_local") else p.shape
        for value in optimizer.state.get(p, {}).values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if torch.is_tensor(local) and local.dim() and local.shape != shape:
                return (f"checkpoint {path} does not hold this model's optimizer state; pass "
                        "--no-resume")
    return None


def space_problem(folder, needed, elsewhere):
    """Why folder's disk cannot take `needed` more bytes (and 1 MiB to spare), or None;
    elsewhere: how to save somewhere else."""
    free = shutil.disk_usage(folder).free
    if free >= needed + 2**20:
        return None
    return (f"not enough space to save into {folder}: the save needs {needed / 2**20:,.1f} MiB, "
            f"{free / 2**20:,.1f} MiB are free; free space there (delete older checkpoints or "
            f"other files), or {elsewhere}")


@contextlib.contextmanager
def saving(prefixes, needed, elsewhere, sharded=False):
    """Around a save to paths that start with prefixes: the free space checked first (needed:
    rank 0's bytes; sharded: each rank's, summed per node), then a failed write stops every rank
    in one line and the half-written prefix*.tmp are removed."""
    if sharded:
        sizes, node = [None] * dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
        dist.all_gather_object(sizes, needed)
        first = dist.get_rank() // node * node  # torchrun numbers each node's ranks in a row
        needed = sum(sizes[first:first + node])
    checks = os.environ["LOCAL_RANK"] == "0" if sharded else dist.get_rank() == 0
    folder = os.path.dirname(prefixes[0])
    agree_on_error(checks and space_problem(folder, needed, elsewhere) or None)
    error = None
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = write_problem(e, prefixes[0], elsewhere)
        if error is None:
            raise
        for prefix in prefixes if checks else ():
            for leftover in glob.glob(f"{glob.escape(prefix)}*.tmp"):
                with contextlib.suppress(OSError):
                    shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)
    agree_on_error(error)


def write_problem(error, path, elsewhere):
    """The line of a failed write of path (an OSError, torch.save's RuntimeError, a DCP
    CheckpointException's cause), or None if error is not one."""
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
