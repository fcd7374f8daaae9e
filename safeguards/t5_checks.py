"""t5_fsdp_finetune.py's checks, each a function that returns the line to stop with, or None:
flags that cannot work together, the local inputs (data, model directory, hub) said at once,
before the hub is tried (its retries take 30 s), what --resume and --save-dir hold; and the
choices this world and device make (strategy, precision, where the weights are read from)."""
import contextlib
import glob
import importlib
import json
import math
import os
import shutil

import huggingface_hub
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, T5ForConditionalGeneration

from summarization_dataset import DOWNLOAD_HELP, ROUGE_INSTALL, WikiHowError, check_csv

from .checkpoints import Folder, folder_number, newest_complete, saving
from .describe import fsdp1_full_bytes
from .errors import agree_on_error, in_one_line, one_line, rank0_print, stop_if_diverged
from .flags import compile_problem, fsdp1_strategy
from .report import nbytes, tensors_in

PREFIX = "checkpoint-epoch-"  # the sharded checkpoints' folders: checkpoint-epoch-N
ELSEWHERE = "pass another --save-dir"  # where else a save can go, when a disk is full
# What the one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or --mixed-precision bf16 or fp32 instead of fp16"
MEMORY_ADVICE = ("use a smaller --batch-size, --test-batch-size, --input-length or "
                 "--output-length, or --activation-checkpointing")


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


# What --fsdp-version 2 has no equivalent for, refused in one line that says what to use instead.
NOT_IN_FSDP2 = {
    ("sharding_strategy", "NO_SHARD"): "--sharding-strategy NO_SHARD (FSDP1 deprecates it): use "
    "FULL_SHARD or SHARD_GRAD_OP, or DistributedDataParallel to replicate (ddp_mnist.py)",
    ("backward_prefetch", "BACKWARD_POST"): "--backward-prefetch BACKWARD_POST: it prefetches the "
    "next block as BACKWARD_PRE does (the default); leave the flag out",
    ("backward_prefetch", "NONE"): "--backward-prefetch NONE: it always prefetches the next block "
    "as BACKWARD_PRE does (the default); leave the flag out",
    ("limit_all_gathers", True): "--limit-all-gathers: FSDP2 bounds its all-gathers itself; leave "
    "the flag out",
    ("limit_all_gathers", False): "--no-limit-all-gathers: FSDP2 bounds its all-gathers itself; "
    "leave the flag out",
    ("mixed_precision", "fp16"): "--mixed-precision fp16 (this script has no grad scaler for "
    "FSDP2): use bf16, or fp32",
}


def fsdp2_problem(args):
    """A flag that --fsdp-version 2 has no equivalent for (NOT_IN_FSDP2), or None."""
    for (flag, value), instead in NOT_IN_FSDP2.items() if args.fsdp_version == 2 else ():
        if getattr(args, flag) == value:
            return f"--fsdp-version 2 has no {instead}"
    return None


def flag_problem(args, device, world_size, marker):
    """Why these flags and inputs cannot train, or None: flag combinations, then the local inputs,
    then what --resume and --save-dir hold (marker: the file that marks a checkpoint complete)."""
    sharded = args.save_model and args.checkpoint_type == "sharded"
    if args.checkpoint_type == "sharded" and not args.save_model:
        return "--checkpoint-type sharded writes checkpoints; --no-save-model turns them off"
    if args.resume == "auto" and args.checkpoint_type != "sharded":
        return "--resume auto resumes from the checkpoints of --checkpoint-type sharded"
    if (problem := fsdp2_problem(args) or rouge_problem(args) or lora_problem(args)):
        return problem
    if args.compile and args.fsdp_version == 1:  # (torch 2.14: dynamo breaks each graph there)
        return ("--compile: torch.compile cannot trace FSDP1's units (flat parameters, "
                "use_orig_params=False: every block would run eagerly); use --fsdp-version 2")
    if args.compile and args.max_tokens:
        return ("--compile compiles each block for one shape (--input-length, --output-length); "
                "--max-tokens cuts micro-batches of other lengths, each compiled anew: drop one")
    longest = args.input_length + args.output_length  # an example's tokens at most
    if args.max_tokens is not None and args.max_tokens < longest:  # micro-batches of at most N
        return (f"--max-tokens {args.max_tokens} is less than --input-length + --output-length "
                f"({longest}), the tokens of the longest example; pass at least {longest}")
    if args.full_state_dict is False and args.fsdp_version == 1:
        return ("--no-full-state-dict: FSDP1 writes its HF files from the full state dict; FSDP2 "
                "(--fsdp-version 2) writes them from every rank's shards")
    if (problem := input_problem(args.data_dir, os.path.expanduser(args.model_name))):
        return problem
    if args.lora_rank and (problem := lora_targets_problem(args.model_name, args.lora_targets)):
        return problem
    if (problem := resume_problem(args.resume, t5_folder(args.save_dir, marker), args.epochs,
                                  args.overwrite, sharded, lora=lora_settings(args))):
        return problem
    return compile_problem(device) if args.compile else None


def input_problem(data_dir, name):
    """Why the data or the model cannot be read, or None: what is missing said together, first
    (before the hub is tried), then a CSV or a model directory that cannot serve."""
    csv_path = os.path.join(data_dir, "wikihowAll.csv")
    missing = [] if os.path.isfile(csv_path) else [f"{csv_path} not found: {DOWNLOAD_HELP}"]
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~"))):
        missing.append(f"--model-name {name}: no such directory; pass a directory written by "
                       "save_pretrained (config.json, model weights, tokenizer files) or a hub id "
                       "such as t5-base")
    elif not os.path.isdir(name) and (problem := hub_problem(name)):
        missing.append(problem)
    if missing:
        return "; and ".join(missing)
    try:  # their first lines: a wrong file or folder is refused before any process loads it
        check_csv(data_dir)
    except WikiHowError as e:
        return str(e)
    if os.path.isdir(name) and (problem := model_folder_problem(name)):
        return (f"cannot load a T5 model and tokenizer from the directory {name} ({problem}); "
                "pass --model-name with a directory written by save_pretrained, or a hub id")
    return None


def rouge_problem(args):
    """--rouge and its options: what cannot work, or None."""
    if args.rouge and not args.run_validation:
        return ("--rouge scores summaries of the validation articles; --no-run-validation turns "
                "validation off")
    if args.rouge:
        try:
            importlib.import_module("rouge_score")
        except ImportError:
            return (f"--rouge needs the rouge_score package, which is not installed: "
                    f"{ROUGE_INSTALL}")
    needs_rouge = [flag for flag, value, default in (
        ("--num-beams", args.num_beams, 1), ("--generation-max-length",
                                             args.generation_max_length, None),
        ("--generate", args.generate, "gathered"), ("--best-metric", args.best_metric,
                                                    "val_loss")) if value != default]
    if needs_rouge and not args.rouge:
        return f"{', '.join(needs_rouge)}: for the summaries that --rouge generates; add --rouge"
    return None


def lora_problem(args):
    """The LoRA flags that cannot work, or None."""
    if args.base_dtype != "fp32" and not args.lora_rank:
        return (f"--base-dtype {args.base_dtype} stores the frozen base of LoRA; add --lora-rank, "
                "or for full fine-tuning use --mixed-precision bf16 (which keeps fp32 master "
                "weights)")
    if args.base_dtype == "bf16" and args.mixed_precision == "fp16":
        return ("--base-dtype bf16 with --mixed-precision fp16 would cast the bf16 base to fp16, "
                "whose range is smaller; use --mixed-precision bf16 or fp32")
    return None


def lora_settings(args):
    """The LoRA flags' settings (add_lora's keyword arguments), or None for full fine-tuning. A
    LoRA run records them in its checkpoints: a resume must train the same adapters."""
    if not args.lora_rank:
        return None
    return {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
            "targets": sorted(args.lora_targets), "base_dtype": args.base_dtype}


def lora_targets_problem(name, targets):
    """Why --lora-targets would not find its modules in the model --model-name names (read from
    its config.json alone, the model built on the meta device), or None. PEFT finds a target by
    the last parts of a module's name: "q" is every attention's q."""
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(name))
    except Exception:  # not readable here (the hub): PEFT's own error says it, after loading
        return None
    with torch.device("meta"):
        names = [n for n, m in T5ForConditionalGeneration(config).named_modules()
                 if isinstance(m, nn.Linear)]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not missing:
        return None
    linear = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    return (f"--lora-targets {','.join(targets)}: the model has no Linear module named "
            f"{', '.join(missing)}; its Linear modules are named {linear}")


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


def model_folder_problem(name):
    """Why the directory --model-name holds no T5 model, read from its config.json, or None (the
    loader says what else is wrong: checked_model)."""
    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        return "it holds no config.json"
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return None if model_type in (None, "t5") else f"it holds a {model_type} model, not T5"


def hub_problem(name):
    """Why --model-name, a hub id, cannot be loaded here, or None: offline (HF_HUB_OFFLINE) and not
    in the Hugging Face cache, or the hub out of reach. Without this, the hub client retries for
    30 s, in 10 log lines, before transformers says it cannot connect."""
    cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    endpoint = huggingface_hub.constants.ENDPOINT
    where = (f"--model-name {name} is not a local directory nor in the Hugging Face cache "
             f"({huggingface_hub.constants.HF_HUB_CACHE})")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None if cached else (f"{where}, and HF_HUB_OFFLINE forbids downloading it; pass a "
                                    "directory written by save_pretrained, or download it first")
    try:  # one request, through the proxies the hub client would use, without its retries
        huggingface_hub.get_session().head(endpoint, timeout=10)
    except Exception as e:
        if not cached:
            return (f"{where}, and {endpoint} cannot be reached ({one_line(e)}); pass a "
                    "directory written by save_pretrained, or run where the hub is reachable")
        rank0_print(f"{endpoint} cannot be reached: --model-name {name} loads from the cache after "
                    "the hub client's retries (HF_HUB_OFFLINE=1 skips them)")
    return None


def checked_model(load, name, on_meta):
    """load(name, on_meta) (the model and tokenizer), any failure turned into one line naming
    --model-name and the fix (a ValueError); a model that is not a T5 with its own tokenizer,
    which would train quietly wrong, refused."""
    where = (f"the directory {name}" if os.path.isdir(name)
             else f"{name!r} (no such directory; tried the hub)")
    with in_one_line(f"cannot load a T5 model and tokenizer from {where}", "pass "
                            "--model-name with a save_pretrained directory, or a hub id on a "
                            "machine with network"):
        model, tokenizer = load(name, on_meta)
        config = model.config
        if config.model_type != "t5":
            raise ValueError(f"it holds a {config.model_type} model, not T5")
        # Without its tokenizer files, T5Tokenizer quietly builds an almost empty vocabulary
        # that maps every word to <unk>: a model then learns nothing, with losses that look fine.
        if not 0.9 * config.vocab_size <= len(tokenizer) <= config.vocab_size:
            raise ValueError(f"its tokenizer has {len(tokenizer)} tokens for a model of "
                             f"{config.vocab_size} embeddings: tokenizer files are missing or "
                             "belong to another model")
    return model, tokenizer


def sharding_choice(args, device):
    """The sharding strategy and mixed precision that this world and device allow: FSDP1's
    NO_SHARD where there is nothing to shard over (fsdp1_strategy); auto and unsupported bf16
    resolved as the tutorial's bf16_ready check."""
    strategy = args.sharding_strategy
    if args.fsdp_version == 1:
        strategy = fsdp1_strategy(strategy)
    bf16_ready = device.type == "cpu" or (  # CPU kernels and gloo handle bf16
        torch.cuda.is_bf16_supported(including_emulation=False)
        and torch.cuda.nccl.version() >= (2, 10))
    choice = args.mixed_precision
    if choice == "auto":  # on CPU bf16 runs, but without native bf16 units it is slower than fp32
        return strategy, "bf16" if device.type == "cuda" and bf16_ready else "fp32"
    if choice in ("bf16", "grad-bf16") and not bf16_ready:
        rank0_print(f"--mixed-precision {choice}: this GPU has no native bf16; using fp32")
        return strategy, "fp32"
    return strategy, choice


def safetensors_to_read(name):
    """FSDP2's --cpu-ram-efficient-loading: the folder of --model-name's safetensors files (a
    directory, or the hub cache's snapshot of a hub id), from which every rank reads its shards;
    None, said in one line, where there are none (a .bin model; a hub model not downloaded yet):
    rank 0 then loads it whole and broadcasts the shards."""
    if os.path.isdir(name):
        folder = name if glob.glob(os.path.join(glob.escape(name), "*.safetensors")) else None
    else:  # a hub id: its snapshot in the hub's cache, if it has been downloaded
        cached = [huggingface_hub.try_to_load_from_cache(name, file)
                  for file in ("model.safetensors", "model.safetensors.index.json")]
        folder = next((os.path.dirname(path) for path in cached if isinstance(path, str)), None)
    if folder is None:
        rank0_print("--cpu-ram-efficient-loading: the model has no safetensors files (a .bin): "
                    "rank 0 loads it whole and broadcasts each rank's shards")
    return folder


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

