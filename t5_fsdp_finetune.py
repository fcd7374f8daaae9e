"""FSDP1 fine-tuning of Hugging Face T5 for WikiHow summarization, on GPUs or on CPU.

It teaches FSDP1 on a real pretrained model: one FSDP unit per T5Block (transformer auto-wrap),
device_id initialization, sharding strategies, backward prefetch, the tutorial's mixed-precision
policies, activation checkpointing, the rank-0 streaming full-state-dict save, and sharded (DCP)
checkpoints that a run resumes from. The FSDP part is wrap_model(); describe_fsdp() prints what
it built. After the PyTorch tutorial "Advanced Model Training with Fully Sharded Data Parallel".

    python t5_fsdp_finetune.py                           # one process per GPU, or 2 CPU processes
    torchrun --nproc_per_node 4 t5_fsdp_finetune.py --sharding-strategy SHARD_GRAD_OP \\
        --activation-checkpointing --checkpoint-type sharded --save-dir runs/t5
    torchrun --nproc_per_node 4 --max-restarts 3 t5_fsdp_finetune.py --checkpoint-type sharded \\
        --save-dir runs/t5 --resume auto                 # restarts resume after the last epoch
    python t5_fsdp_finetune.py --cpu --model-name tiny-t5 --data-dir tiny-data --input-length 64 \\
        --output-length 24 --num-train-samples 64 --num-val-samples 31    # the tests' fixtures

The data: wikihowAll.csv in --data-dir (README.md, "Getting the data"), read by
summarization_dataset.py. CUDA + NCCL when a GPU is visible, else CPU + gloo. The "Plumbing"
section at the end is the same in all four scripts and not part of the lesson.
"""
import argparse
import datetime
import fcntl
import functools
import gc
import glob
import json
import math
import os
import re
import resource
import shutil
import socket
import sys
import tempfile
import time
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import _init_utils as fsdp_init_utils
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoConfig, T5ForConditionalGeneration, T5Tokenizer
from transformers.models.t5.modeling_t5 import T5Block
from transformers.utils import logging as hf_logging

from summarization_dataset import wikihow


# ----------------------------------------------------------------------------------- model, data
def load_model_and_tokenizer(name, on_meta=False):
    """The pretrained model in fp32 (FSDP's master weights) and its tokenizer. on_meta: only the
    model's structure, on the meta device, without loading or allocating any weight."""
    name = os.path.expanduser(name)
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~"))):
        raise ValueError(f"--model-name {name}: no such directory; pass a directory written by "
                         "save_pretrained (config.json, model weights, tokenizer files) or a hub "
                         "id such as t5-base")
    try:
        config = AutoConfig.from_pretrained(name)
        if config.model_type != "t5":
            raise ValueError(f"it holds a {config.model_type} model, not T5")
        tokenizer = T5Tokenizer.from_pretrained(name)
        # Without its tokenizer files, T5Tokenizer quietly builds an almost empty vocabulary that
        # maps every word to <unk>: a model then learns nothing, with losses that look fine.
        if not 0.9 * config.vocab_size <= len(tokenizer) <= config.vocab_size:
            raise ValueError(f"its tokenizer has {len(tokenizer)} tokens for a model of "
                             f"{config.vocab_size} embeddings: tokenizer files are missing or "
                             "belong to another model")
        if on_meta:
            with torch.device("meta"):
                model = T5ForConditionalGeneration(config)
        else:
            model = T5ForConditionalGeneration.from_pretrained(name, dtype=torch.float32)
    except Exception as e:
        where = (f"the directory {name}" if os.path.isdir(name)
                 else f"{name!r} (no such directory; tried the hub)")
        raise ValueError(f"cannot load a T5 model and tokenizer from {where}: {one_line(e)}. Pass "
                         "--model-name with a save_pretrained directory, or a hub id on a machine "
                         "with network") from None
    return model, tokenizer


def load_data(args, tokenizer):
    """The train and validation sets (no validation set with --no-run-validation); a WikiHowError
    (a ValueError) says what is wrong with the data."""
    options = {"input_length": args.input_length, "output_length": args.output_length,
               "data_dir": args.data_dir}
    train_set = wikihow(tokenizer, "train", args.num_train_samples, **options)
    val_set = None
    if args.run_validation:
        val_set = wikihow(tokenizer, "validation", args.num_val_samples, **options)
    return train_set, val_set


def one_line(error):
    """The last line of an exception's message, where the reason is, without a final period."""
    lines = str(error).strip().splitlines()
    return " ".join(lines[-1].split()).rstrip(".") if lines else type(error).__name__


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


# ------------------------------------------------------------------------------------------ FSDP
# The tutorial's four policies. FSDP keeps fp32 master weights; these set the compute (param),
# gradient-communication (reduce) and buffer dtypes. A dtype left out is not cast.
POLICIES = {  # MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)
    "fp32": MixedPrecision(torch.float32, torch.float32, torch.float32),
    "bf16": MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": MixedPrecision(torch.float16, torch.float16, torch.float16),
    "grad-bf16": MixedPrecision(reduce_dtype=torch.bfloat16),
}


def mixed_precision_choice(choice, device):
    """The policy to use: auto and unsupported bf16 resolve as the tutorial's bf16_ready check."""
    bf16_ready = device.type == "cpu" or (  # CPU kernels and gloo handle bf16
        torch.cuda.is_bf16_supported(including_emulation=False)
        and torch.cuda.nccl.version() >= (2, 10))
    if choice == "auto":  # on CPU bf16 runs, but without native bf16 units it is slower than fp32
        return "bf16" if device.type == "cuda" and bf16_ready else "fp32"
    if choice in ("bf16", "grad-bf16") and not bf16_ready:
        rank0_print(f"--mixed-precision {choice}: this GPU has no native bf16; using fp32")
        return "fp32"
    return choice


def wrap_model(model, args, device):
    """FSDP1 with one unit per T5Block: each rank keeps its shard of the parameters, gradients
    and optimizer state; a unit's parameters are gathered only while it computes."""
    strategy = ShardingStrategy[args.sharding_strategy]
    world_size, local_world_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    if strategy != ShardingStrategy.NO_SHARD and (world_size == 1 or local_world_size == 1 and
                                                  strategy == ShardingStrategy.HYBRID_SHARD):
        # Nothing to shard with. FSDP1 would switch to NO_SHARD with a warning, and for HYBRID_SHARD
        # on nodes of one process reduce within each node only: each node would train on its own.
        rank0_print(f"{strategy.name} with one process{' per node' * (world_size > 1)}: NO_SHARD")
        strategy = ShardingStrategy.NO_SHARD
    # HYBRID_SHARD shards within a node and replicates across nodes: a (nodes, node size) mesh.
    # With a mesh, FSDP1's sharded state dicts hold DTensors, not the deprecated ShardedTensors.
    mesh = init_device_mesh(device.type, (world_size // local_world_size, local_world_size)
                            if strategy == ShardingStrategy.HYBRID_SHARD else (world_size,))
    on_meta = any(p.is_meta for p in model.parameters())  # --cpu-ram-efficient-loading, rank > 0
    if args.cpu_ram_efficient_loading and device.type == "cpu":
        # Workaround: FSDP1 (torch 2.14) refuses sync_module_states for CPU tensors, assuming
        # NCCL, although gloo broadcasts them; skip that one check. Remove it when FSDP1 lets
        # gloo runs sync CPU modules (tests/test_t5.py's loading tests pass without it).
        fsdp_init_utils._check_module_states_for_sync_module_states = lambda states: None
    model = FSDP(
        model,  # on CPU; device_id moves it to the device one FSDP unit at a time
        # A unit per T5Block; the shared embedding (encoder, decoder, lm_head) stays in the root.
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={T5Block}),
        sharding_strategy=strategy,
        device_mesh=mesh,
        mixed_precision=POLICIES[mixed_precision_choice(args.mixed_precision, device)],
        backward_prefetch=(None if args.backward_prefetch == "NONE"
                           else BackwardPrefetch[args.backward_prefetch]),
        limit_all_gathers=args.limit_all_gathers,
        device_id=device,  # also on CPU: without it FSDP1 looks for an accelerator and refuses
        # --cpu-ram-efficient-loading: only rank 0 has the weights; the others allocate their
        # units' memory (param_init_fn) and receive rank 0's values (sync_module_states).
        sync_module_states=args.cpu_ram_efficient_loading,
        param_init_fn=materialize_on(device) if on_meta else None,
    )
    if args.activation_checkpointing:
        # Only checkpoint_impl is passed: the tutorial also passed offload_to_cpu=False, which newer
        # torch hands on to T5Block.forward (the TypeError of pytorch/examples#1210). Non-reentrant
        # checkpointing takes T5Block's keyword arguments and restores the RNG state when it
        # recomputes, so dropout masks, and losses, are those of a run without it.
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, T5Block),
                                       checkpoint_wrapper_fn=functools.partial(
                                           checkpoint_wrapper,
                                           checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


def materialize_on(device):
    """FSDP's param_init_fn for a model built on the meta device: each module's own parameters and
    buffers get (uninitialized) memory on device. Unlike module.to_empty(), a parameter that two
    modules share (T5's embedding and lm_head) stays one tensor, so the model stays tied."""
    # id of a meta tensor -> weak references to it and to its replacement: FSDP frees a unit's
    # full parameters once it has sharded them, and this memo must not keep them alive.
    made = {}

    def param_init_fn(module):
        for kind, tensors in (("parameters", module._parameters), ("buffers", module._buffers)):
            for name, tensor in tensors.items():
                if tensor is None or not tensor.is_meta:
                    continue
                refs = made.get(id(tensor))  # the same tensor met in another module: tied
                replacement = refs[1]() if refs and refs[0]() is tensor else None
                if replacement is None:
                    replacement = torch.empty_like(tensor, device=device)
                    if kind == "parameters":
                        replacement = nn.Parameter(replacement, tensor.requires_grad)
                    made[id(tensor)] = (weakref.ref(tensor), weakref.ref(replacement))
                tensors[name] = replacement

    return param_init_fn


def describe_fsdp(model):
    """Print what FSDP built, read from the wrapped model itself rather than from the flags."""
    dtypes = [str(d).replace("torch.", "") for d in vars(model.mixed_precision).values()][:3]
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    rank0_print(f"FSDP built {len(FSDP.fsdp_modules(model))} units: "
                f"{model.sharding_strategy.name}, backward prefetch "
                f"{getattr(model.backward_prefetch, 'name', 'NONE')}, limit_all_gathers "
                f"{model.limit_all_gathers}, mixed precision param {dtypes[0]} reduce {dtypes[1]} "
                f"buffer {dtypes[2]} (None: not cast), "
                f"activation checkpointing of {checkpointed} T5Blocks")
    sizes = {}  # (kind of unit, parameters, on rank 0) -> how many units
    for unit in FSDP.fsdp_modules(model):
        flat = unit._flat_param  # private: the unit's own parameters, flattened and sharded
        inner = unit.module.module if isinstance(unit.module, CheckpointWrapper) else unit.module
        key = (type(inner).__name__, flat._unpadded_unsharded_size.numel() if flat is not None
               else 0, flat.numel() if flat is not None else 0)
        sizes[key] = sizes.get(key, 0) + 1
    for (kind, total, local), count in sizes.items():
        rank0_print(f"  {count} x {kind}: {total:,} parameters each, {local:,} on rank 0")


# ------------------------------------------------------------------------------------------ step
def per_example_loss(logits, target_ids):
    """Cross-entropy of each example, averaged over its real target tokens (labels -100: padding).

    HF's own loss is a token mean over the whole batch; a mean per example makes the epoch loss
    independent of how examples are batched and spread over ranks."""
    losses = F.cross_entropy(logits.float().transpose(1, 2), target_ids, ignore_index=-100,
                             reduction="none")
    return losses.sum(dim=1) / (target_ids != -100).sum(dim=1)


def forward(model, batch):
    # use_cache=False: the decoder's key/value cache is for generation. In training it only costs
    # memory, and under activation checkpointing the recomputed forward saves other tensors than
    # the first one did (CheckpointError: "A different number of tensors was saved").
    return model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                 labels=batch["target_ids"], use_cache=False).logits


def train(model, loader, optimizer, scaler, epoch, device):
    model.train()
    loader.sampler.set_epoch(epoch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed example losses, examples
    for step, batch in enumerate(tqdm(loader, desc=f"r0 Training Epoch {epoch}", colour="blue",
                                      leave=False, disable=dist.get_rank() != 0), 1):
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        losses = per_example_loss(forward(model, batch), batch["target_ids"])
        stop_if_diverged(f"the loss of epoch {epoch}, step {step}", [losses], DIVERGED)
        if scaler:  # fp16: scale the loss so that small gradients do not underflow
            scaler.scale(losses.mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.mean().backward()
            optimizer.step()
        totals += torch.stack([losses.detach().sum(), torch.tensor(len(losses), device=device)])
    dist.all_reduce(totals)
    rank0_print(f"Train Epoch: \t{epoch}, Loss: \t{totals[0] / totals[1]:.4f}")
    return (totals[0] / totals[1]).item()


def validation(model, loader, device):
    model.eval()
    sampler, seen = loader.sampler, 0
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed example losses, examples
    with torch.no_grad():
        for batch in tqdm(loader, desc="Validation Epoch", colour="green", leave=False,
                          disable=dist.get_rank() != 0):
            batch = {k: v.to(device) for k, v in batch.items()}
            losses = per_example_loss(forward(model, batch), batch["target_ids"])
            # DistributedSampler repeats examples to give every rank as many batches (FSDP needs
            # all ranks in every forward): count each example once, by its index rank + k * ranks.
            index = sampler.rank + sampler.num_replicas * torch.arange(seen, seen + len(losses))
            real = (index < len(sampler.dataset)).to(device)
            seen += len(losses)
            totals += torch.stack([losses[real].sum(), real.sum()])
    dist.all_reduce(totals)
    if not torch.isfinite(totals[0]):  # the same on every rank: it is reduced
        fail(f"training diverged: the validation loss is {totals[0].item()}; {DIVERGED}")
    rank0_print(f"Validation Loss: {totals[0] / totals[1]:.4f}")
    return (totals[0] / totals[1]).item()


# ------------------------------------------------------------------------------------ checkpoint
TRAINER_STATE = "trainer_state.json"  # written last into a sharded checkpoint: marks it complete


def export_model(model, tokenizer, path):
    """Rank 0 writes path.pt (the full state dict) and the HF directory path-hf; all ranks call it.
    get_model_state_dict with full_state_dict + cpu_offload is the tutorial's streaming
    FULL_STATE_DICT save (FullStateDictConfig(offload_to_cpu=True, rank0_only=True)) without the
    deprecated FSDP.state_dict_type context: parameters are gathered one FSDP unit at a time and
    only rank 0 keeps them, on CPU."""
    stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)  # never export it
    # Workaround: a CPU run's tensors are in host memory already, and offloading them there breaks
    # the gather in torch 2.11 ("setStorage: ... storage of size 0"; fine in 2.14): there every
    # rank gets them. Remove it once requirements.txt asks for torch >= 2.14.
    on_gpu = next(model.parameters()).device.type != "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return
    torch.save(state, f"{path}.pt.tmp")
    os.replace(f"{path}.pt.tmp", f"{path}.pt")
    with torch.device("meta"):  # no second random initialization: the weights come from state
        plain = T5ForConditionalGeneration(model.module.config)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    plain.generation_config = model.module.generation_config
    shutil.rmtree(f"{path}-hf.tmp", ignore_errors=True)
    plain.save_pretrained(f"{path}-hf.tmp")
    tokenizer.save_pretrained(f"{path}-hf.tmp")
    shutil.rmtree(f"{path}-hf", ignore_errors=True)
    os.replace(f"{path}-hf.tmp", f"{path}-hf")
    rank0_print(f"Saved {path}.pt and {path}-hf")


def save_sharded_checkpoint(model, optimizer, trainer_state, path):
    """Every rank writes its shards of the model and optimizer state with DCP into path.tmp; rank 0
    adds trainer_state.json and renames path.tmp to path: a checkpoint is always complete."""
    stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)  # never save it
    if dist.get_rank() == 0:
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=f"{path}.tmp")
    if dist.get_rank() == 0:
        with open(os.path.join(f"{path}.tmp", TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(f"{path}.tmp", path)
        rank0_print(f"Saved sharded checkpoint {path}")
    dist.barrier()


def find_checkpoint(path):
    """path if it is a complete checkpoint, else the newest complete checkpoint-epoch-N in it."""
    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return path
    epochs = {}
    for folder in glob.glob(os.path.join(path, "checkpoint-epoch-*")):
        match = re.search(r"checkpoint-epoch-(\d+)$", folder)
        if match and os.path.isfile(os.path.join(folder, TRAINER_STATE)):
            epochs[int(match.group(1))] = folder
    return epochs[max(epochs)] if epochs else None


def start_afresh(args):
    """Without --resume, --save-dir must hold no sharded checkpoint: a later --resume auto would
    take an older run's later epochs for this run's. --overwrite deletes them first (the Hugging
    Face convention: refuse a non-empty folder unless told to)."""
    old = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint-epoch-*")))
    if args.resume or not old:
        return
    if not args.overwrite:
        fail(f"--save-dir {args.save_dir} holds sharded checkpoints of an earlier run "
             f"({os.path.basename(old[-1])}...), which a later --resume would mix with this run's; "
             "add --resume auto to continue it, --overwrite to delete them, or pass another "
             "--save-dir")
    dist.barrier()  # everyone has seen them before rank 0 deletes them
    if dist.get_rank() == 0:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        rank0_print(f"--overwrite: deleted {len(old)} checkpoint(s) of an earlier run")


def resume(model, optimizer, scheduler, scaler, args):
    """The trainer state of the sharded checkpoint --resume names, loaded into model, optimizer,
    scheduler and grad scaler (at any world size); None to start afresh."""
    path = args.resume
    if path == "auto":  # the newest complete checkpoint of --save-dir, if there is one yet
        box = [find_checkpoint(args.save_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
        if not path:
            rank0_print(f"No checkpoint in {os.path.abspath(args.save_dir)} yet: starting from "
                        "epoch 1")
    if not path:
        return None
    checkpoint = find_checkpoint(path) if os.path.isdir(path) else None
    agree_on_error(None if checkpoint else (
        f"--resume {path}: no complete checkpoint there (a directory with {TRAINER_STATE}, or one "
        "holding checkpoint-epoch-N directories; *.tmp ones are incomplete)"))
    error = None
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE)) as f:
            state = json.load(f)
        folder = re.fullmatch(r"checkpoint-epoch-(\d+)", os.path.basename(checkpoint))
        if not (isinstance(state.get("epoch"), int) and state["epoch"] >= 1) or (
                folder and int(folder.group(1)) != state["epoch"]):
            raise ValueError(f"its {TRAINER_STATE} says epoch {state.get('epoch')!r}, not its "
                             "folder's")
        model_state, optim_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optimizer": optim_state}
        dcp.load(loaded, checkpoint_id=checkpoint)  # DCP raises on every rank if any rank fails
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        error = (f"--resume {checkpoint}: cannot load it ({one_line(e).split('. ')[0][:300]}); it "
                 "is corrupted, or was saved for another model")
    agree_on_error(error)
    scheduler.load_state_dict(state["scheduler"])
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if state["epoch"] >= args.epochs:
        fail(f"--resume: the checkpoint has finished epoch {state['epoch']} of --epochs "
             f"{args.epochs}; raise --epochs to train further")
    rank0_print(f"Resumed from {checkpoint} (epoch {state['epoch']} done)")
    return state


# ------------------------------------------------------------------------------------------ main
def main(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    # Workarounds for warnings that say nothing a user can act on (torch 2.14): FSDP1's optimizer
    # state-dict code calls a torch-internal helper that warns about its own deprecation; FSDP1
    # under NO_SHARD (one process) warns at every state_dict that it returns a full state dict.
    warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are "
                            r"registered|full_state_dict will be returned)")
    on_meta = args.cpu_ram_efficient_loading and rank > 0  # rank 0 alone loads the weights
    model, tokenizer = local_rank_zero_first(
        lambda: load_model_and_tokenizer(args.model_name, on_meta))
    train_set, val_set = local_rank_zero_first(lambda: load_data(args, tokenizer))
    rank0_print(f"Size of train dataset: {len(train_set)}, validation dataset: "
                f"{len(val_set) if val_set else 'none (--no-run-validation)'}")
    loader_kwargs = {"num_workers": 2, "pin_memory": True} if device.type == "cuda" else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, **loader_kwargs,
                              sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed))
    val_loader = val_set and DataLoader(val_set, batch_size=args.test_batch_size, **loader_kwargs,
                                        sampler=DistributedSampler(val_set, shuffle=False))

    model = wrap_model(model, args, device)
    describe_fsdp(model)
    loaded = Report(args, device)
    loaded.memory(model)  # each rank's peak so far: what loading and wrapping the model cost it
    peaks = ", ".join(f"{peak / 2**20:.1f}" for peak in loaded.peaks)
    rank0_print(f"Peak memory per rank after loading the model: {peaks} MiB")
    precision = mixed_precision_choice(args.mixed_precision, device)
    optimizer = optim.AdamW(model.parameters(), lr=args.lr)  # after wrapping: sees the shards
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    scaler = ShardedGradScaler(device=device.type) if precision == "fp16" else None
    state = resume(model, optimizer, scheduler, scaler, args) or {
        "epoch": 0, "best_val_loss": None, "best_checkpoint": None, "train_losses": [],
        "val_losses": []}
    # Checked, and --save-dir made, only now: bad input found before leaves nothing behind.
    check_outputs(args, {"--save-dir": args.save_model and os.path.abspath(args.save_dir)})
    if args.save_model and args.checkpoint_type == "sharded":
        lock_folder("--save-dir", args.save_dir)
        start_afresh(args)
    run_name = f"T5-model-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M%S')}"
    report, train_times, epoch_times = Report(args, device), [], []
    for epoch in range(state["epoch"] + 1, args.epochs + 1):
        # Reseeded per epoch and rank: a resumed run's dropout draws what it would have drawn.
        torch.manual_seed(args.seed * 100_003 + epoch * 1_009 + rank)
        state["train_losses"].append(train(model, train_loader, optimizer, scaler, epoch, device))
        train_times.append(report.lap())
        val_loss = validation(model, val_loader, device) if val_loader else None
        state["val_losses"].append(val_loss)
        scheduler.step()
        epoch_times.append(train_times[-1] + report.lap())
        rank0_print(f"Epoch {epoch} time: {epoch_times[-1]:.2f}s")
        if args.track_memory:
            kind = "CUDA allocated" if device.type == "cuda" else "process RSS"
            rank0_print(f"Peak memory per rank ({kind}): "
                        f"{report.memory(model, optimizer)[1] / 2**20:.1f} MiB")
        # Without validation there is nothing to compare: the last epoch's model is saved.
        improved = epoch == args.epochs if val_loss is None else (
            state["best_val_loss"] is None or val_loss < state["best_val_loss"])
        if improved and val_loss is not None:
            state["best_val_loss"] = val_loss
            rank0_print(f"-->>>> New Val Loss Record: {val_loss:.4f}")
        if improved and args.save_model:
            name = f"{run_name}-{epoch}" + (f"-{val_loss:.4f}" if val_loss is not None else "")
            state["best_checkpoint"] = os.path.abspath(os.path.join(args.save_dir, name))
            export_model(model, tokenizer, state["best_checkpoint"])
        if args.save_model and args.checkpoint_type == "sharded":
            state.update(epoch=epoch, scheduler=scheduler.state_dict(),
                         scaler=scaler.state_dict() if scaler else None)
            save_sharded_checkpoint(model, optimizer, state,
                                    os.path.join(args.save_dir, f"checkpoint-epoch-{epoch}"))
        report.lap()
    samples_per_s = len(train_loader.sampler) * world_size * len(train_times) / sum(train_times)
    rank0_print(f"Training: {samples_per_s:.1f} samples/s")
    report.training_done(model, optimizer)
    best = state["best_checkpoint"]
    report.write(train_loss=state["train_losses"][-1], train_losses=state["train_losses"],
                 val_loss=state["best_val_loss"], val_losses=state["val_losses"],
                 epoch_times=epoch_times, samples_per_s=samples_per_s,
                 train_batches=len(train_loader), val_batches=len(val_loader or ()),
                 peak_memory_after_loading_per_rank=loaded.peaks,
                 checkpoint=best and f"{best}-hf", checkpoint_pt=best and f"{best}.pt",
                 mixed_precision=precision, sharding_strategy=model.sharding_strategy.name)


# What the plumbing's one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or --mixed-precision bf16 or fp32 instead of fp16"
MEMORY_ADVICE = ("use a smaller --batch-size, --test-batch-size, --input-length or "
                 "--output-length, or --activation-checkpointing")


def parse_args():
    parser = RankZeroArgumentParser(
        description="PyTorch T5 FSDP fine-tuning example (WikiHow summarization)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add, on_off = parser.add_argument, argparse.BooleanOptionalAction
    add("--model-name", default="t5-base", help="hub id or save_pretrained directory of a T5")
    add("--data-dir", default="data", help="folder of wikihowAll.csv (and all_train/val/test.txt)")
    add("--batch-size", type=positive(int), default=4, metavar="N", help="batch per process")
    add("--test-batch-size", type=positive(int), default=4, metavar="N", help="validation batch")
    add("--epochs", type=positive(int), default=2, metavar="N", help="number of epochs to train")
    add("--lr", type=positive(float, most=1e30), default=0.002, metavar="LR",
        help="AdamW learning rate, at most 1e30 (much larger ones overflow float32)")
    add("--gamma", type=positive(float, zero=True, most=1), default=0.7, metavar="M",
        help="learning rate step gamma per epoch")
    add("--seed", type=positive(int, zero=True, most=2**32 - 1), default=1, metavar="S",
        help="random seed (dropout, shuffling)")
    add("--num-train-samples", type=positive(int), default=1500, metavar="N", help="first N "
        "articles of the train split")
    add("--num-val-samples", type=positive(int), default=300, metavar="N", help="first N articles "
        "of the validation split")
    add("--input-length", type=positive(int, most=16384), default=512, metavar="N",
        help="article tokens (truncated or padded to N)")
    add("--output-length", type=positive(int, most=16384), default=150, metavar="N",
        help="summary tokens (truncated or padded to N; the loss ignores the padding)")
    add("--sharding-strategy", default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
        help="FULL_SHARD shards parameters, gradients and optimizer state (ZeRO-3); SHARD_GRAD_OP "
             "keeps parameters gathered from forward to backward (ZeRO-2); NO_SHARD is DDP-like; "
             "HYBRID_SHARD shards within a node and replicates across nodes")
    add("--backward-prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST",
        "NONE"], help="when to all-gather the next unit's parameters in backward")
    add("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "fp32", "grad-bf16"],
        help="auto: bf16 on GPUs with native bf16, else fp32 (also on CPU); bf16/fp16: compute, "
             "gradient reduction and buffers in that dtype (fp16 with a sharded grad scaler); "
             "grad-bf16: gradient reduction only; bf16 falls back to fp32 where unsupported")
    add("--activation-checkpointing", action="store_true",
        help="recompute each T5Block's activations in backward instead of storing them")
    add("--limit-all-gathers", action=on_off, default=True,
        help="rate-limit FSDP's all-gathers so that prefetching cannot exhaust GPU memory")
    add("--track-memory", action=on_off, default=True, help="print peak memory every epoch")
    add("--run-validation", action=on_off, default=True,
        help="compute the validation loss every epoch (without: the last epoch's model is saved)")
    add("--save-model", action=on_off, default=True,
        help="save the model when the validation loss improves: T5-model-<date>-<epoch>-<loss>.pt "
             "(full state dict) and the HF directory ...-hf, with the tokenizer")
    add("--checkpoint-type", default="full", choices=["full", "sharded"],
        help="full: only the best model, gathered on rank 0; sharded: also a resumable DCP "
             "checkpoint (every rank writes its shards) per epoch: <save-dir>/checkpoint-epoch-N")
    add("--resume", metavar="DIR|auto",
        help="continue from a sharded checkpoint: a checkpoint-epoch-N directory, or a --save-dir "
             "holding them (the newest complete one); auto: the newest in --save-dir if there is "
             "one, else start afresh (for torchrun --max-restarts)")
    add("--cpu-ram-efficient-loading", action="store_true",
        help="only rank 0 loads the pretrained weights; the others build the model on the meta "
             "device and receive rank 0's weights through FSDP's sync_module_states (accelerate's "
             "fsdp_cpu_ram_efficient_loading)")
    add("--save-dir", default=".", help="folder for saved models and checkpoints")
    add("--overwrite", action="store_true", help="without --resume, delete the sharded "
        "checkpoints already in --save-dir")
    add("--cpu", action="store_true", help="CPU and gloo even if there are GPUs")
    add("--world-size", type=positive(int), metavar="N", help="processes to start without "
        "torchrun (None: one per GPU, or 2 on CPU)")
    add("--dist-timeout", type=positive(float), default=600, metavar="S", help="seconds to wait "
        "for a lost or hung peer before the job fails (longer than tokenizing the dataset)")
    add("--metrics-json", metavar="PATH", help="write the final metrics to PATH (rank 0)")
    args = parser.parse_args()
    if args.checkpoint_type == "sharded" and not args.save_model:
        parser.error("--checkpoint-type sharded writes checkpoints; --no-save-model turns them off")
    if args.resume == "auto" and args.checkpoint_type != "sharded":
        parser.error("--resume auto resumes from the checkpoints of --checkpoint-type sharded")
    return args


# ==================================================================================================
# Plumbing, not part of the lesson and the same, byte for byte, in all four scripts (checked by
# tests/test_layout.py): rank-0 printing, one error line instead of a traceback per rank, output
# checks and locks, time and memory figures, the metrics file, process-group set-up, launching.
# It calls the script's main(args, device) and parse_args(), and quotes its MEMORY_ADVICE.
# ==================================================================================================

def rank0_print(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fail(message, node_local=False):
    """Exit 1 on this rank with one error line: rank 0 (node_local: each node's local rank 0) says
    it at once; another rank only after 10 s, which it does not live to see when rank 0 says it
    too (torchrun stops all workers once one has failed), but does when the problem is its own."""
    if int(os.environ.get("LOCAL_RANK" if node_local else "RANK", "0")) != 0:
        time.sleep(10)
        message = f"rank {os.environ['RANK']}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def agree_on_error(error):
    """Fail on every rank if any rank found an error (a message), so that none waits for ever."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        fail(next(e for e in errors if e))


def check_outputs(args, folders, files=None):
    """Fail unless rank 0 can create a file in each {flag: folder} (made if missing) and write
    each {flag: file} and --metrics-json: a bad path then fails in seconds, not at the first save.
    """
    files = {**(files or {}), "--metrics-json": args.metrics_json}
    error = None
    for flag, path in files.items():
        if path and os.path.isdir(path):
            error = f"{flag}: {path} is a folder; pass a file's path"
        folders.setdefault(flag, path and os.path.dirname(os.path.abspath(path)))
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


def stop_if_diverged(where, tensors, advice):
    """Fail on every rank, in one line, if any of the tensors (a loss, or a model's parameters) is
    NaN or infinite on any rank: a diverged run must not go on, nor save what it has become."""
    bad = torch.zeros((), device=tensors[0].device)
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensors
        bad += (~torch.isfinite(tensor.detach())).any()
    dist.all_reduce(bad)
    if bad:
        fail(f"training diverged: {where} is not finite (NaN or infinite); {advice}")


class Report:
    """Times the run (on a GPU with CUDA events too), measures memory per rank, prints both and
    writes --metrics-json: the figures of every script, plus the script's own (write())."""

    def __init__(self, args, device):
        self.args, self.device, self.start, self.laps = args, device, time.perf_counter(), []
        self.cuda = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self.cuda = self.cuda if device.type == "cuda" else None
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

    def training_done(self, model, optimizer):
        self.wall_s = time.perf_counter() - self.start
        if self.cuda:
            self.cuda[1].record()
            self.cuda[1].synchronize()
            seconds = self.cuda[0].elapsed_time(self.cuda[1]) / 1000
            rank0_print(f"CUDA event elapsed time: {seconds:.3f}sec")
        else:
            rank0_print(f"Wall-clock elapsed time: {self.wall_s:.3f}sec")
        self.state, self.peak = self.memory(model, optimizer)
        rank0_print(f"Peak memory per rank ({'CUDA allocated' if self.cuda else 'process RSS'}): "
                    f"{self.peak / 2**20:.1f} MiB; parameters + gradients + optimizer state: "
                    f"{self.state / 2**20:.3f} MiB")

    def write(self, **metrics):
        """Rank 0 writes --metrics-json, under a temporary name first: never half-written."""
        if self.args.metrics_json and dist.get_rank() == 0:
            metrics = {"script": os.path.basename(__file__), "world_size": dist.get_world_size(),
                       "device": self.device.type, "backend": dist.get_backend(), "wall_s":
                       self.wall_s, "train_state_bytes": self.state, "peak_memory_bytes":
                       self.peak, "peak_memory_per_rank": self.peaks, **metrics}
            with open(f"{self.args.metrics_json}.tmp", "w") as f:
                json.dump(metrics, f, indent=2)
            os.replace(f"{self.args.metrics_json}.tmp", self.args.metrics_json)


def init_process_group(backend, timeout):
    """dist.init_process_group, with a store prefix of its own for each torchrun restart.

    Workaround: torchrun (torch 2.14, 2.15) shares one store between the restarts of
    --max-restarts without a prefix per restart: restarted workers read the addresses of those
    they replace and fail, "Connection refused" (as in pytorch/pytorch#167288). Remove it when
    tests/test_faults.py passes without it."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.init_process_group(backend, timeout=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"restart_{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


@record  # an unexpected exception reaches torchrun's report as the root cause
def run_worker(args, use_cuda):
    """main(args, device) in this process's process group; a lost peer ends it in one line."""
    gpus, local_world_size = torch.cuda.device_count(), int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda and local_world_size > gpus:
        fail(f"{local_world_size} processes on this node but {gpus} GPUs visible; start at most "
             "one process per GPU (torchrun --nproc_per_node)", node_local=True)
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    try:  # a collective that waits longer than --dist-timeout for a peer fails, not hangs
        init_process_group("nccl" if use_cuda else "gloo",
                           datetime.timedelta(seconds=args.dist_timeout))
        main(args, device)  # its model and optimizer are garbage once it returns
    except (torch.OutOfMemoryError, MemoryError) as e:
        fail(f"out of memory ({' '.join(str(e).split()).split('. ')[0]}): {MEMORY_ADVICE}")
    except RuntimeError as e:
        reason = re.search(r"can't allocate memory[^.]*", str(e))  # a failed CPU allocation
        if reason:
            fail(f"out of memory ({reason[0]}): {MEMORY_ADVICE}")
        if not (isinstance(e, dist.DistError) or "gloo" in str(e)):  # gloo's are RuntimeErrors
            raise
        reason = re.sub(r"^\[[^]]*\] ", "", str(e).strip().splitlines()[0])  # gloo's source line
        print(f"error: rank {os.environ['RANK']}: a collective failed ({reason}): another rank "
              "died, hung or lost its network, or took longer than --dist-timeout "
              f"{args.dist_timeout:g}s; see the other ranks' logs", file=sys.stderr, flush=True)
        sys.exit(1)  # said by every rank that notices: the rank that was lost may be rank 0
    finally:
        # Workaround: FSDP and DDP keep the process group alive through reference cycles; freed
        # only at exit, gloo's threads can abort a finished run with SIGABRT ("terminate called
        # without an active exception"; torch 2.14, 2.15). Free them while Python still can.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Faster exit, not a fix: Python's last collection at exit walks every object torch made
        # (0.6 s per process, a good part of a short run); frozen, they go with the process.
        gc.freeze()


def spawn_worker(rank, args, use_cuda, world_size, port):
    # What torchrun would set, so that both ways to launch run the same code.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: share the cores out
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    run_worker(args, use_cuda)


def launch(args):
    """Under torchrun, run in this process; started with python, spawn --world-size processes
    (default: one per GPU, or 2 on CPU) that meet on a free port of this machine."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    if "RANK" in os.environ:
        if args.world_size not in (None, int(os.environ["WORLD_SIZE"])):
            fail(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE "
                 f"{os.environ['WORLD_SIZE']}; leave --world-size out under torchrun")
        return run_worker(args, use_cuda)
    gpus = torch.cuda.device_count() if use_cuda else 0
    world_size = args.world_size or gpus or 2
    if world_size > gpus > 0:
        fail(f"--world-size {world_size} asks for more GPUs than the {gpus} present")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(spawn_worker, args=(args, use_cuda, world_size, port), nprocs=world_size)
    except mp.ProcessExitedException as e:  # the failing worker has said why
        sys.exit(e.exit_code or 1)
    gc.freeze()  # a faster exit, as in run_worker


class RankZeroArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # once, from rank 0, instead of once per torchrun worker
        if int(os.environ.get("RANK", "0")) == 0:
            super().error(message)
        fail(message)


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


if __name__ == "__main__":
    launch(parse_args())
