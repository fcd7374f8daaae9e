"""FSDP1 fine-tuning of Hugging Face T5 for WikiHow summarization, on GPUs or on CPU.

A working version of the PyTorch tutorial "Advanced Model Training with Fully Sharded Data
Parallel (FSDP)": transformer auto-wrap on T5Block, device_id initialization, sharding
strategies, backward prefetch, mixed precision, activation checkpointing and the rank-0
streaming full-state-dict save, plus sharded (DCP) checkpoints that a run resumes from.

    torchrun --nproc_per_node 4 t5_fsdp_finetune.py                       # data/wikihowAll.csv, t5-base
    torchrun --nproc_per_node 4 t5_fsdp_finetune.py --sharding-strategy SHARD_GRAD_OP \\
        --activation-checkpointing --checkpoint-type sharded --save-dir runs/t5
    torchrun --nproc_per_node 4 t5_fsdp_finetune.py --checkpoint-type sharded --save-dir runs/t5 \\
        --resume runs/t5 --epochs 4                                       # continue from the newest checkpoint
    torchrun --nproc_per_node 4 --max-restarts 3 t5_fsdp_finetune.py --checkpoint-type sharded \
        --save-dir runs/t5 --resume auto                                  # restarts resume at the last epoch
    torchrun --nproc_per_node 2 t5_fsdp_finetune.py --cpu --model-name tiny-t5 --input-length 64 \\
        --output-length 24 --num-train-samples 64 --num-val-samples 31    # CPU, gloo, a local model dir

CUDA + NCCL are used when a GPU is visible, CPU + gloo otherwise (or with --cpu). Get the data
with the commands in README.md ("Getting the data"); summarization_dataset.py reads it.
"""
import argparse
import datetime
import functools
import gc
import glob
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import T5ForConditionalGeneration, T5Tokenizer
from transformers.models.t5.modeling_t5 import T5Block
from transformers.utils import logging as hf_logging

from summarization_dataset import wikihow

TRAINER_STATE = "trainer_state.json"  # written last into a sharded checkpoint: marks it complete
# The tutorial's four policies. FSDP keeps fp32 master weights; these set the compute (param),
# gradient-communication (reduce) and buffer dtypes. A dtype left out is not cast.
POLICIES = {
    "fp32": MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32),
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
    "fp16": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16),
    "grad-bf16": MixedPrecision(reduce_dtype=torch.bfloat16),
}


def rank0_print(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fail(message, node_local=False):
    """Stop this rank with exit code 1. Rank 0 says what is wrong in one line, without a traceback (with
    node_local, each node's local rank 0 does: for a problem of one node)."""
    if int(os.environ.get("LOCAL_RANK" if node_local else "RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        wait_for_rank0_to_report()
    sys.exit(1)


def wait_for_rank0_to_report():
    """torchrun stops every worker as soon as one fails: a rank that left first could have rank 0 killed before
    it prints why. Rank 0 exits right after its line, and torchrun then stops the ranks still waiting here."""
    time.sleep(10)


def agree_on_error(error):
    """Fail on every rank if any rank found an error, so that no rank waits forever for the others."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        fail(first)


def output_error(outputs):
    """Why a file cannot be written into one of the {flag: directory} folders (made if missing), or None.
    Checked before training, so that a bad path fails the run in seconds instead of at the first save."""
    for flag, directory in outputs.items():
        if not directory:
            continue
        if os.path.exists(directory) and not os.path.isdir(directory):
            return f"{flag}: {directory} is a file, so nothing can be written into it; pass another path"
        try:
            os.makedirs(directory, exist_ok=True)
            tempfile.TemporaryFile(dir=directory).close()  # creating a file is the only test that holds for root too
        except OSError as e:
            return f"{flag}: cannot write into {directory} ({e.strerror or e}); pass a writable directory"
    return None


def peer_lost(error):
    """Whether a failed collective means another rank stopped answering: gloo raises a RuntimeError naming
    its transport, the other backends a DistError. (NCCL's watchdog usually ends the process itself.)"""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


def one_line(error):
    """The last line of an exception's message (where the reason is), without a trailing period."""
    lines = str(error).strip().splitlines()
    return " ".join(lines[-1].split()).rstrip(".") if lines else type(error).__name__


def local_rank_zero_first(load):
    """load() on each node's local rank 0, then on its other ranks, so that downloads and the datasets
    cache are written once per node. A ValueError on any rank stops every rank with its message."""
    result = None
    for first in (True, False):
        error = None
        if (int(os.environ["LOCAL_RANK"]) == 0) == first:
            try:
                result = load()
            except ValueError as e:
                error = str(e)
        agree_on_error(error)
    return result


def load_model_and_tokenizer(name):
    name = os.path.expanduser(name)
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~"))):
        raise ValueError(f"--model-name {name}: no such directory; pass a directory written by save_pretrained "
                         "(config.json, model weights, tokenizer files) or a hub id such as t5-base")
    try:
        tokenizer = T5Tokenizer.from_pretrained(name)
        model = T5ForConditionalGeneration.from_pretrained(name, dtype=torch.float32)  # fp32 master weights
    except Exception as e:
        where = f"the directory {name}" if os.path.isdir(name) else f"{name!r} (no such directory; tried the hub)"
        raise ValueError(f"cannot load a T5 model and tokenizer from {where}: {one_line(e)}. Pass --model-name "
                         "with a save_pretrained directory, or a hub id on a machine with network") from None
    return model, tokenizer


def load_data(args, tokenizer):
    """The train and validation sets; a WikiHowError (a ValueError) says what is wrong with the data."""
    return (wikihow(tokenizer, "train", args.num_train_samples, args.input_length, args.output_length,
                    data_dir=args.data_dir),
            wikihow(tokenizer, "validation", args.num_val_samples, args.input_length, args.output_length,
                    data_dir=args.data_dir))


def mixed_precision_choice(choice, device):
    """The policy name to use: auto and unsupported bf16 resolve as the tutorial's bf16_ready check does."""
    if device.type == "cuda":
        bf16_ready = torch.cuda.is_bf16_supported(including_emulation=False) and torch.cuda.nccl.version() >= (2, 10)
    else:
        bf16_ready = True  # CPU kernels and gloo handle bf16
    if choice == "auto":
        # On CPU bf16 runs, but without native bf16 units it is slower than fp32 and less precise: keep fp32.
        return "bf16" if device.type == "cuda" and bf16_ready else "fp32"
    if choice in ("bf16", "grad-bf16") and not bf16_ready:
        rank0_print(f"--mixed-precision {choice}: this GPU has no native bf16; falling back to fp32")
        return "fp32"
    return choice


def per_example_loss(logits, target_ids):
    """Cross-entropy of each example, averaged over its real target tokens (labels -100 are padding).

    HF's own loss is a token mean over the whole batch; a per-example mean makes the epoch loss
    independent of how examples are batched and spread over ranks."""
    losses = F.cross_entropy(logits.float().transpose(1, 2), target_ids, ignore_index=-100, reduction="none")
    return losses.sum(dim=1) / (target_ids != -100).sum(dim=1)


def forward(model, batch):
    # use_cache=False: the decoder's key/value cache is for generation. In training it only costs memory,
    # and under activation checkpointing the recomputed forward saves other tensors than the first one
    # did (CheckpointError: "A different number of tensors was saved").
    return model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=batch["target_ids"],
                 use_cache=False).logits


def train(model, loader, optimizer, scaler, epoch, device):
    model.train()
    loader.sampler.set_epoch(epoch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed per-example loss, examples
    for batch in tqdm(loader, desc=f"r0 Training Epoch {epoch}", colour="blue", disable=dist.get_rank() != 0,
                      leave=False):
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        losses = per_example_loss(forward(model, batch), batch["target_ids"])
        if scaler:  # fp16: scale the loss so that small gradients do not underflow
            scaler.scale(losses.mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.mean().backward()
            optimizer.step()
        totals[0] += losses.detach().sum()
        totals[1] += len(losses)
    dist.all_reduce(totals)
    train_loss = (totals[0] / totals[1]).item()
    rank0_print(f"Train Epoch: \t{epoch}, Loss: \t{train_loss:.4f}")
    return train_loss


def validation(model, loader, device):
    model.eval()
    sampler = loader.sampler
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed per-example loss, examples
    seen = 0
    with torch.no_grad():
        for batch in tqdm(loader, desc="Validation Epoch", colour="green", disable=dist.get_rank() != 0,
                          leave=False):
            batch = {k: v.to(device) for k, v in batch.items()}
            losses = per_example_loss(forward(model, batch), batch["target_ids"])
            # DistributedSampler repeats examples so that every rank runs the same number of batches
            # (FSDP needs every rank in every forward). Count each example once: this rank's k-th
            # example sits at position rank + k * world_size of the padded list.
            position = sampler.rank + sampler.num_replicas * torch.arange(seen, seen + len(losses), device=device)
            real = position < len(sampler.dataset)
            seen += len(losses)
            totals[0] += losses[real].sum()
            totals[1] += real.sum()
    dist.all_reduce(totals)
    val_loss = (totals[0] / totals[1]).item()
    rank0_print(f"Validation Loss: {val_loss:.4f}")
    return val_loss


def train_state_bytes(model, optimizer):
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards under FSDP)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def max_over_ranks(value, device):
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def peak_memory(device):
    """CUDA max allocated on GPU, peak RSS of the process on CPU (ru_maxrss is in KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_report(device):
    gb = 2**30
    if device.type == "cuda":
        allocated, reserved = (max_over_ranks(f(device), device) for f in (torch.cuda.memory_allocated,
                                                                           torch.cuda.memory_reserved))
        return (f"CUDA memory (max over ranks): allocated {allocated / gb:.4f} GB, reserved {reserved / gb:.4f} GB, "
                f"peak allocated {max_over_ranks(peak_memory(device), device) / gb:.4f} GB")
    return f"Process memory (max over ranks): peak RSS {max_over_ranks(peak_memory(device), device) / gb:.4f} GB"


def export_best_model(model, tokenizer, path):
    """Rank 0 writes path.pt (the full state dict) and the HF directory path-hf; every rank must call this.

    get_model_state_dict with full_state_dict + cpu_offload is the streaming FULL_STATE_DICT save of
    the tutorial (FullStateDictConfig(offload_to_cpu=True, rank0_only=True)) without the deprecated
    FSDP.state_dict_type context: parameters are gathered one FSDP unit at a time and only rank 0
    keeps them, on CPU."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    torch.save(state, f"{path}.pt.tmp")
    os.replace(f"{path}.pt.tmp", f"{path}.pt")
    hf_model = model.module  # the T5ForConditionalGeneration inside the root FSDP unit
    with torch.device("meta"):  # no second random initialization: the weights come from state
        plain = T5ForConditionalGeneration(hf_model.config)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    plain.generation_config = hf_model.generation_config
    tmp = f"{path}-hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(f"{path}-hf", ignore_errors=True)
    os.replace(tmp, f"{path}-hf")
    rank0_print(f"Saved {path}.pt and {path}-hf")


def save_sharded_checkpoint(model, optimizer, trainer_state, path):
    """Every rank writes its shards of model and optimizer state with DCP into path.tmp; rank 0 adds
    trainer_state.json and renames path.tmp to path, so a checkpoint directory is always complete."""
    tmp = f"{path}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        rank0_print(f"Saved sharded checkpoint {path}")
    dist.barrier()


def find_checkpoint(path):
    """path itself if it is a complete checkpoint, else the newest complete checkpoint-epoch-N in it."""
    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return path
    epochs = {int(m.group(1)): d for d in glob.glob(os.path.join(path, "checkpoint-epoch-*"))
              if (m := re.search(r"checkpoint-epoch-(\d+)$", d)) and os.path.isfile(os.path.join(d, TRAINER_STATE))}
    return epochs[max(epochs)] if epochs else None


def load_sharded_checkpoint(model, optimizer, path):
    """Load a save_sharded_checkpoint directory (any world size) into model and optimizer; return its trainer state."""
    checkpoint = find_checkpoint(path) if os.path.isdir(path) else None
    agree_on_error(None if checkpoint else f"--resume {path}: no complete checkpoint there (a directory with "
                   f"{TRAINER_STATE}, or one holding checkpoint-epoch-N directories; *.tmp ones are incomplete)")
    error = None
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE)) as f:
            trainer_state = json.load(f)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=checkpoint)  # DCP raises on every rank if any rank fails
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        reason = one_line(e).split(". ")[0][:300]
        error = f"--resume {checkpoint}: cannot load it ({reason}); it is corrupted, or was saved for another model"
    agree_on_error(error)
    rank0_print(f"Resumed from {checkpoint} (epoch {trainer_state['epoch']} done)")
    return trainer_state


def train_and_validate(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    use_cuda = device.type == "cuda"
    model, tokenizer = local_rank_zero_first(lambda: load_model_and_tokenizer(args.model_name))
    train_set, val_set = local_rank_zero_first(lambda: load_data(args, tokenizer))
    rank0_print(f"Size of train dataset: {len(train_set)}, validation dataset: {len(val_set)}")
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    loader_kwargs = {"num_workers": 2, "pin_memory": True} if use_cuda else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, **loader_kwargs)
    val_loader = DataLoader(val_set, batch_size=args.test_batch_size, sampler=val_sampler, **loader_kwargs)

    precision = mixed_precision_choice(args.mixed_precision, device)
    strategy = ShardingStrategy[args.sharding_strategy]
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if strategy == ShardingStrategy.HYBRID_SHARD and local_world_size == 1 < world_size:
        # One process per node leaves nothing to shard within a node. FSDP1 would clamp the size-1 shard group
        # to NO_SHARD and then never all-reduce across the nodes: every node would train on its own.
        rank0_print("HYBRID_SHARD with one process per node only replicates: using NO_SHARD over all ranks")
        strategy = ShardingStrategy.NO_SHARD
    # HYBRID_SHARD shards within a node and replicates across nodes: a (nodes, processes per node) mesh.
    # With a mesh, FSDP1's sharded state dicts hold DTensors instead of the deprecated ShardedTensors.
    mesh = init_device_mesh(device.type, (world_size // local_world_size, local_world_size)
                            if strategy == ShardingStrategy.HYBRID_SHARD else (world_size,))
    model = FSDP(
        model,  # on CPU; device_id moves it to the device one FSDP unit at a time
        # Each T5Block is a unit; the shared embedding (used by encoder, decoder and lm_head) stays in the root unit.
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
        sharding_strategy=strategy,
        device_mesh=mesh,
        mixed_precision=POLICIES[precision],
        backward_prefetch=None if args.backward_prefetch == "NONE" else BackwardPrefetch[args.backward_prefetch],
        limit_all_gathers=args.limit_all_gathers,
        device_id=device,  # also on CPU: without it FSDP1 looks for an accelerator and refuses to start
    )
    if args.activation_checkpointing:
        # Only checkpoint_impl is passed: the tutorial's code also passed offload_to_cpu=False, which newer
        # torch hands on to T5Block.forward (the TypeError of pytorch/examples#1210). Non-reentrant
        # checkpointing takes T5Block's keyword arguments and restores the RNG state when it recomputes,
        # so dropout masks, and losses, are those of a run without it.
        apply_activation_checkpointing(
            model, check_fn=lambda module: isinstance(module, T5Block),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    units = sum(isinstance(m, FSDP) for m in model.modules())
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    rank0_print(f"FSDP: {units} units, {strategy.name}, backward prefetch {args.backward_prefetch}, "
                f"mixed precision {precision}, activation checkpointing of {checkpointed} T5Blocks")
    optimizer = optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    scaler = ShardedGradScaler(device=device.type) if precision == "fp16" else None

    state = {"epoch": 0, "best_val_loss": None, "best_checkpoint": None, "train_losses": [], "val_losses": []}
    resume = args.resume
    if resume == "auto":  # the newest complete checkpoint of this --save-dir, if there is one yet
        box = [find_checkpoint(args.save_dir) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        resume = box[0]
        if not resume:
            rank0_print(f"No checkpoint in {os.path.abspath(args.save_dir)} yet: starting from epoch 1")
    if resume:
        state = load_sharded_checkpoint(model, optimizer, resume)
        scheduler.load_state_dict(state["scheduler"])
        if scaler and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if state["epoch"] >= args.epochs:
            fail(f"--resume: the checkpoint has finished epoch {state['epoch']} of --epochs {args.epochs}; "
                 "raise --epochs to train further")
    time_of_run = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    # Checked, and --save-dir made, only now: a run stopped by bad input before this leaves nothing behind.
    metrics_dir = args.metrics_json and os.path.dirname(os.path.abspath(args.metrics_json))
    outputs = {"--save-dir": args.save_model and os.path.abspath(args.save_dir), "--metrics-json": metrics_dir}
    agree_on_error(output_error(outputs) if rank == 0 else None)
    start = time.perf_counter()
    epoch_times, train_time, trained_samples = [], 0.0, 0
    for epoch in range(state["epoch"] + 1, args.epochs + 1):
        # Reseeded per epoch and rank: dropout in a resumed run draws what it would have drawn uninterrupted.
        torch.manual_seed(args.seed * 100_003 + epoch * 1_009 + rank)
        epoch_start = time.perf_counter()
        state["train_losses"].append(train(model, train_loader, optimizer, scaler, epoch, device))
        train_time += time.perf_counter() - epoch_start
        trained_samples += len(train_sampler) * world_size
        val_loss = validation(model, val_loader, device) if args.run_validation else None
        state["val_losses"].append(val_loss)
        scheduler.step()
        epoch_times.append(time.perf_counter() - epoch_start)
        rank0_print(f"Epoch {epoch} time: {epoch_times[-1]:.2f}s")
        if args.track_memory:
            rank0_print(memory_report(device))

        if args.run_validation:
            improved = state["best_val_loss"] is None or val_loss < state["best_val_loss"]
            if improved:
                state["best_val_loss"] = val_loss
                rank0_print(f"-->>>> New Val Loss Record: {val_loss:.4f}")
        else:
            improved = epoch == args.epochs  # nothing to compare: save the last epoch's model
        if improved and args.save_model:
            name = f"T5-model-{time_of_run}-{epoch}" + (f"-{val_loss:.4f}" if args.run_validation else "")
            export_best_model(model, tokenizer, os.path.join(args.save_dir, name))
            state["best_checkpoint"] = os.path.abspath(os.path.join(args.save_dir, name))
        if args.save_model and args.checkpoint_type == "sharded":
            state.update(epoch=epoch, scheduler=scheduler.state_dict(), scaler=scaler.state_dict() if scaler else None)
            save_sharded_checkpoint(model, optimizer, state, os.path.join(args.save_dir, f"checkpoint-epoch-{epoch}"))
    wall_s = time.perf_counter() - start
    samples_per_s = trained_samples / train_time
    rank0_print(f"Training time: {wall_s:.2f}s, {samples_per_s:.1f} training samples/s")

    # Sizes are fixed from the first optimizer step on; the last step's gradients are still held.
    state_bytes = max_over_ranks(train_state_bytes(model, optimizer), device)
    peak = max_over_ranks(peak_memory(device), device)
    rank0_print(f"Parameters + gradients + optimizer state per rank: {state_bytes / 2**20:.2f} MB")

    if args.metrics_json and rank == 0:
        best = state["best_checkpoint"]
        metrics = {
            "script": os.path.basename(__file__), "world_size": world_size, "device": device.type,
            "backend": dist.get_backend(), "train_loss": state["train_losses"][-1],
            "train_losses": state["train_losses"], "val_loss": state["best_val_loss"],  # the best, saved one
            "val_losses": state["val_losses"], "wall_s": wall_s, "epoch_times": epoch_times,
            "samples_per_s": samples_per_s, "train_state_bytes": state_bytes, "peak_memory_bytes": peak,
            "checkpoint": best and f"{best}-hf", "checkpoint_pt": best and f"{best}.pt",
            "mixed_precision": precision, "sharding_strategy": strategy.name,
        }
        with open(f"{args.metrics_json}.tmp", "w") as f:
            json.dump(metrics, f, indent=2)
        os.replace(f"{args.metrics_json}.tmp", args.metrics_json)


def init_process_group(backend, timeout):
    """dist.init_process_group, with each torchrun restart's keys apart in torchrun's store.

    torchrun (torch 2.15) keeps one store for all the restarts that --max-restarts allows, and no longer
    gives each restart's keys their own prefix: the restarted workers would read the addresses of the
    workers they replace and fail with "Connection refused". So under torchrun the keys get one."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"restart_{restart}", store), timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and not args.cpu
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda and local_world_size > torch.cuda.device_count():
        fail(f"{local_world_size} processes on this node but {torch.cuda.device_count()} GPUs visible; start at most "
             "one process per GPU (torchrun --nproc_per_node).", node_local=True)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    # FSDP1's optimizer state-dict code calls a torch-internal helper that warns, on every rank and at
    # every sharded save and load, about that helper's own deprecation: nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are registered)")

    try:
        # A collective that waits longer than --dist-timeout for a peer fails the job instead of hanging it.
        init_process_group(backend, timeout=datetime.timedelta(seconds=args.dist_timeout))
        train_and_validate(args, device)  # its model and optimizer are garbage once it returns
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        # Said by every rank that notices: the rank that was lost may be rank 0.
        reason = re.sub(r"^\[[^]]*\] ", "", str(e).strip().splitlines()[0])  # gloo prefixes its source location
        print(f"error: rank {os.environ['RANK']}: a collective failed ({reason}): another rank died, hung or lost "
              f"its network, or took longer than --dist-timeout {args.dist_timeout:g}s; see the other ranks' logs",
              file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        # FSDP's units keep the process group alive through reference cycles. Free them now, while the
        # interpreter is fully alive: left to the exit, gloo's worker threads can abort a finished run
        # with SIGABRT ("terminate called without an active exception").
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankZeroArgumentParser(argparse.ArgumentParser):
    """Reports a usage error once, from rank 0, instead of once per torchrun worker."""

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:
            super().error(message)
        wait_for_rank0_to_report()
        sys.exit(2)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


if __name__ == "__main__":
    parser = RankZeroArgumentParser(description="PyTorch T5 FSDP fine-tuning example (WikiHow summarization)",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-name", default="t5-base",
                        help="Hugging Face hub id or local save_pretrained directory of a T5 model and tokenizer")
    parser.add_argument("--data-dir", default="data",
                        help="folder holding wikihowAll.csv (and the split lists all_train/val/test.txt)")
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="N",
                        help="input batch size per process for training")
    parser.add_argument("--test-batch-size", type=positive_int, default=4, metavar="N",
                        help="input batch size per process for validation")
    parser.add_argument("--epochs", type=positive_int, default=2, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.002, metavar="LR", help="AdamW learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma (per epoch)")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (dropout, shuffling)")
    parser.add_argument("--num-train-samples", type=positive_int, default=1500, metavar="N",
                        help="use the first N articles of the train split")
    parser.add_argument("--num-val-samples", type=positive_int, default=300, metavar="N",
                        help="use the first N articles of the validation split")
    parser.add_argument("--input-length", type=positive_int, default=512, metavar="N",
                        help="article tokens (truncated or padded to N)")
    parser.add_argument("--output-length", type=positive_int, default=150, metavar="N",
                        help="summary tokens (truncated or padded to N; padding is ignored by the loss)")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD",
                        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                        help="FULL_SHARD shards parameters, gradients and optimizer state (ZeRO-3); SHARD_GRAD_OP "
                             "keeps parameters gathered from forward to backward (ZeRO-2); NO_SHARD is DDP-like; "
                             "HYBRID_SHARD shards within a node and replicates across nodes")
    parser.add_argument("--backward-prefetch", default="BACKWARD_PRE",
                        choices=["BACKWARD_PRE", "BACKWARD_POST", "NONE"],
                        help="when to all-gather the next unit's parameters in backward")
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "fp32", "grad-bf16"],
                        help="auto: bf16 on GPUs with native bf16, else fp32 (also on CPU); bf16/fp16: compute, "
                             "gradient reduction and buffers in that dtype (fp16 with a sharded grad scaler); "
                             "grad-bf16: only gradient reduction in bf16; bf16 falls back to fp32 where unsupported")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each T5Block's activations in backward instead of storing them")
    parser.add_argument("--limit-all-gathers", action=argparse.BooleanOptionalAction, default=True,
                        help="rate-limit FSDP's all-gathers so that prefetching cannot exhaust GPU memory "
                             "(FSDP's own default)")
    parser.add_argument("--track-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="print memory use after every epoch (CUDA allocated/reserved, or process RSS on CPU)")
    parser.add_argument("--run-validation", action=argparse.BooleanOptionalAction, default=True,
                        help="compute the validation loss after every epoch (without it the last epoch's model "
                             "is saved)")
    parser.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=True,
                        help="save the model when the validation loss improves: T5-model-<date>-<epoch>-<loss>.pt "
                             "(full state dict) and the HF directory ...-hf, with the tokenizer")
    parser.add_argument("--checkpoint-type", default="full", choices=["full", "sharded"],
                        help="full: only the best model, gathered on rank 0; sharded: also a resumable DCP "
                             "checkpoint (model and optimizer shards, every rank writes its own) after every "
                             "epoch, in <save-dir>/checkpoint-epoch-N")
    parser.add_argument("--resume", default=None, metavar="DIR|auto",
                        help="continue from a sharded checkpoint: a checkpoint-epoch-N directory, or a --save-dir "
                             "holding them (the newest complete one is used); auto: the newest in --save-dir if "
                             "there is one, else start afresh (for torchrun --max-restarts)")
    parser.add_argument("--save-dir", default=".", help="folder for saved models and checkpoints")
    parser.add_argument("--cpu", action="store_true", help="train on CPU with gloo even when GPUs are present")
    parser.add_argument("--dist-timeout", type=positive_float, default=600, metavar="S",
                        help="seconds a collective waits for the other ranks before the job fails (a lost or hung "
                             "peer); must exceed the longest pause of one rank, such as tokenizing the dataset")
    parser.add_argument("--metrics-json", default=None, metavar="PATH", help="write final metrics to PATH (rank 0)")
    args = parser.parse_args()
    if args.checkpoint_type == "sharded" and not args.save_model:
        parser.error("--checkpoint-type sharded writes checkpoints, which --no-save-model turns off")
    if args.resume == "auto" and args.checkpoint_type != "sharded":
        parser.error("--resume auto resumes from the checkpoints of --checkpoint-type sharded; add it")
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --nproc_per_node 2 t5_fsdp_finetune.py ...")
    main(args)
