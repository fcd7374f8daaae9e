"""t5_fsdp_finetune.py's saves and resumes: --save-dir's checkpoints and the line that says where
a rerun resumes, what --resume may continue (its epoch, its LoRA settings and base), each save
checked (free space, never a diverged model, one line when it fails), an interrupted run's
unfinished exports removed."""
import contextlib
import glob
import json
import math
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from .checkpoints import Folder, folder_number, newest_complete, saving
from .describe import fsdp1_full_bytes
from .errors import agree_on_error, one_line, rank0_print, stop_if_diverged
from .report import nbytes, tensors_in

PREFIX = "checkpoint-epoch-"  # the sharded checkpoints' folders: checkpoint-epoch-N
ELSEWHERE = "pass another --save-dir"  # where else a save can go, when a disk is full


def t5_folder(save_dir, marker):
    """--save-dir's sharded checkpoints (marker: the file written last into each)."""
    return Folder(os.path.abspath(save_dir), "--save-dir", PREFIX, marker, "epoch", 1,
                  "run the same command with --resume auto to resume")


def resume_hint(args, marker):
    """What says where a rerun resumes (when Ctrl-C or SIGTERM stops the run): a text, or the
    function that finds it then."""
    if not (args.save_model and args.checkpoint_type == "sharded"):
        return "no resumable checkpoints (--checkpoint-type full): a rerun starts from epoch 1"
    return t5_folder(args.save_dir, marker).rerun_resumes


def resume_problem(resume, folder, epochs, overwrite, sharded, lora=None):
    """Why the checkpoint --resume names (auto: the newest in --save-dir, folder) cannot be
    resumed, or why --save-dir, without --resume, must not be written into; None if nothing is
    wrong. Read from the files alone, before a model is loaded: a resumed run must have epochs
    left, and a new run must not leave its checkpoints beside an earlier run's."""
    if resume is None:
        return folder.earlier_run_problem("add --resume auto") if sharded and not overwrite else (
            None)
    checkpoint = resume_target(resume, folder)
    if checkpoint is None:
        return None if resume == "auto" else (
            f"--resume {resume}: no complete checkpoint of this script in it (a directory with "
            f"{folder.marker}, or one holding {PREFIX}N directories; *.tmp ones are incomplete)")
    checkpoint = os.path.abspath(checkpoint)
    try:
        with open(os.path.join(checkpoint, folder.marker)) as f:
            saved = json.load(f)
        epoch = saved.get("epoch")
    except (OSError, ValueError, AttributeError) as e:
        return (f"--resume {checkpoint}: cannot load it ({one_line(e)}); it is corrupted, or was "
                "saved for another model")
    if not (isinstance(epoch, int) and epoch >= 1) or folder_number(checkpoint, PREFIX) not in (
            None, epoch):
        return (f"--resume {checkpoint}: cannot load it (its {folder.marker} says epoch "
                f"{epoch!r}, not its folder's); it is corrupted, or was saved for another model")
    if epoch >= epochs:
        return (f"--resume: the checkpoint {checkpoint} has finished epoch {epoch} of --epochs "
                f"{epochs}; raise --epochs to train further")
    if saved.get("lora") != lora:  # what it holds: adapters of that LoRA, or every weight
        return (f"--resume {checkpoint}: it was saved by {lora_flags(saved.get('lora'))}, not "
                f"{lora_flags(lora)}; pass the flags it was saved with, or start afresh (without "
                "--resume, in another --save-dir)")
    return None


def lora_flags(lora):
    """LoRA settings (lora_settings) as the flags that make them; None: full fine-tuning."""
    if not lora:
        return "full fine-tuning"
    flags = {"rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
             "targets": "--lora-targets", "base_dtype": "--base-dtype"}
    return " ".join(f"{flags[key]} {','.join(value) if isinstance(value, list) else value}"
                    for key, value in lora.items())


def base_fingerprint(model):
    """A number that identifies the frozen weights of a LoRA run (None without any): the sum, over
    its tensors, of each one's float64 sum weighted by its place in the state dict. Saved with
    each checkpoint, so that adapters are never resumed onto another base. The sums of shards are
    reduced across ranks (DTensor's full_tensor): any world size and sharding give the same
    number, to about 1e-15."""
    trained = get_model_state_dict(model, options=StateDictOptions(
        ignore_frozen_params=True)).keys()
    total, found = 0.0, False
    for place, (name, tensor) in enumerate(sorted(get_model_state_dict(model).items()), 1):
        if name in trained:
            continue
        tensor_sum = tensor.sum(dtype=torch.float64)  # a DTensor's is partial: full_tensor sums
        total += place * (tensor_sum.full_tensor() if isinstance(tensor_sum, DTensor)
                          else tensor_sum).item()
        found = True
    return total if found else None


def base_problem(path, marker, base):
    """Why the checkpoint at path must not be resumed onto this run's frozen base (base: its
    base_fingerprint; None: full fine-tuning), or None: adapters trained on another base."""
    with open(os.path.join(path, marker)) as f:
        saved = json.load(f).get("base")
    if base is None or math.isclose(saved or 0, base, rel_tol=1e-9):
        return None
    return (f"--resume {path}: its adapters were trained on another base model than --model-name "
            f"(fingerprint {saved!r}, not {base!r}); pass the --model-name it was trained with, "
            "or start afresh without --resume")


def resume_target(resume, folder):
    """The complete checkpoint --resume names, or None: DIR itself if it holds its trainer state
    (HF Trainer's resume_from_checkpoint), else the newest complete checkpoint-epoch-N in DIR
    (auto: in --save-dir, folder)."""
    path = folder.path if resume == "auto" else resume
    if os.path.isfile(os.path.join(path, folder.marker)):
        return path
    return newest_complete(path, PREFIX, folder.marker)


def find_resumable(resume, folder):
    """The complete sharded checkpoint to resume from (resume_target), as rank 0 finds it, on
    every rank; None to start afresh."""
    box = [resume_target(resume, folder) if resume and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if resume == "auto" and not box[0]:
        rank0_print(f"No complete checkpoint in --save-dir {folder.path}: starting from epoch 1")
    return os.path.abspath(box[0]) if box[0] else None


@contextlib.contextmanager
def checked_save(checkpointer, path, folder, advice, sharded=False):
    """Around a save to path (the best model's export; sharded: a resumable checkpoint): never a
    diverged model, the free space checked, a failed write in one line on every rank (its .tmp
    removed; sharded: with where a rerun resumes)."""
    model = checkpointer.model
    stop_if_diverged("a parameter", list(model.parameters()), advice)
    if sharded:  # each rank writes its shards of what trains and of the optimizer state
        trained = [p for p in model.parameters() if p.requires_grad]
        needed = nbytes(tensors_in([trained, list(checkpointer.optimizer.state.values())]))
    else:  # rank 0 writes the full state dict twice: the .pt and the HF files
        needed = 2 * (fsdp1_full_bytes(model) if isinstance(model, FSDP)
                      else nbytes(tensors_in(list(model.parameters()), local=False)))
    resumes = f"; {folder.rerun_resumes()}" if sharded else ""
    with saving([path], needed, ELSEWHERE + resumes, sharded=sharded):
        yield


def remove_unfinished_exports(save_dir):
    """An attempt killed while exporting left its unfinished folder (or .pt) under its own start
    time's name, which no later export replaces: the folder is this job's now (its lock), so rank
    0 removes them and says so; one that cannot be removed stops the run in one line."""
    error, unfinished = None, []
    if dist.get_rank() == 0:
        unfinished = sorted(glob.glob(os.path.join(glob.escape(save_dir), "T5-model-*.tmp")))
        for path in unfinished:
            try:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            except OSError as e:
                error = (f"cannot remove {path}, an unfinished export of an interrupted run "
                         f"({e.strerror or e}); remove it, or pass another --save-dir")
                break
    agree_on_error(error)
    if unfinished:
        rank0_print(f"Removed {len(unfinished)} unfinished export(s) of an interrupted run: "
                    + ", ".join(os.path.basename(path) for path in unfinished))
