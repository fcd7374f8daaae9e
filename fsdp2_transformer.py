"""FSDP2 (fully_shard) training of a small causal Transformer, on GPUs or on CPU.

It teaches the FSDP2 recipe - build on the meta device, fully_shard each block and then the root,
to_empty + reset_parameters, optimizer after sharding - with the options of the PyTorch FSDP2
guide (explicit prefetching, bf16 mixed precision, clipping, resharding, CPU offload, gradient
accumulation) and resumable checkpoints through the DTensor or the DCP API. The FSDP2 part is
shard_model(); describe_sharding() prints what it built. The data: a synthetic next-token task.

    python fsdp2_transformer.py                      # one process per GPU, or 2 CPU processes
    torchrun --nproc_per_node 8 fsdp2_transformer.py --explicit-prefetching --mixed-precision
    torchrun --nproc_per_node 2 fsdp2_transformer.py --checkpoint-dir ckpt --save-every 50 --dcp-api
    torchrun --nproc_per_node 2 --max-restarts 3 fsdp2_transformer.py --checkpoint-dir ckpt
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        fsdp2_transformer.py --dim 1024 --n-layers 16 --n-heads 16 --batch-size 256

CUDA + NCCL when a GPU is visible, else CPU + gloo. --batch-size is the global batch: every world
size trains on the same data. The "Plumbing" section at the end is the same in all four scripts.
"""
import argparse
import datetime
import fcntl
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
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint


# ----------------------------------------------------------------------------------------- model
@torch.no_grad()
def init_(param, fill):
    """Initialize param (a plain tensor or an FSDP2 DTensor shard) with fill(full tensor).

    On CUDA, DTensor's random ops fill each rank's shard with the numbers of its part of the full
    tensor, so no rank ever holds a full tensor: the scalable init. They do that only on CUDA (on
    a CPU mesh every rank draws the same numbers for its shard), so on CPU every rank draws the
    full tensor from the same generator and keeps its shard: the same model at any world size."""
    if param.device.type == "cuda":
        fill(param)
        return
    full = fill(torch.empty(param.shape, dtype=param.dtype))
    if isinstance(param, DTensor):  # keep this rank's shard; src_data_rank=None: no communication
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param, full = param.to_local(), full.to_local()
    param.copy_(full)


def init_linear(linear):
    init_(linear.weight, lambda t: nn.init.normal_(t, std=0.02))
    if linear.bias is not None:
        init_(linear.bias, nn.init.zeros_)


def init_norm(norm):
    init_(norm.weight, nn.init.ones_)
    init_(norm.bias, nn.init.zeros_)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        # No bias: a key bias cannot change softmax attention; Adam would update it from noise.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # t sees positions <= t only
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))

    def reset_parameters(self):
        init_linear(self.qkv)
        init_linear(self.proj)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def reset_parameters(self):
        init_norm(self.attention_norm)
        self.attention.reset_parameters()
        init_norm(self.mlp_norm)
        init_linear(self.mlp[0])
        init_linear(self.mlp[2])


class Transformer(nn.Module):
    def __init__(self, vocab_size, dim, n_layers, n_heads, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size)
        self.activation_checkpointing = False  # see shard_model() and forward()
        self.reset_parameters()  # a no-op on the meta device; after to_empty, call it again

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            if self.activation_checkpointing:  # keep only x; recompute the block in backward
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        # Workaround: self.output(x) gives the same numbers, but F.linear of a 3-D input with a
        # bias returns a view, and FSDP2 (torch 2.14) warns about every root output that is a
        # view, since an in-place op on it would skip its hooks. matmul + bias makes no view.
        return torch.matmul(self.norm(x), self.output.weight.t()) + self.output.bias

    def reset_parameters(self):
        """Initialize every parameter of the model, the blocks' included."""
        init_(self.tok_embeddings.weight, lambda t: nn.init.normal_(t, std=0.02))
        init_(self.pos_embeddings.weight, lambda t: nn.init.normal_(t, std=0.02))
        for layer in self.layers:
            layer.reset_parameters()
        init_norm(self.norm)
        init_linear(self.output)


def model_config(args):
    return {k: getattr(args, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len")}


# ------------------------------------------------------------------------------------------ data
NUM_RULES = 4  # hidden permutations of the synthetic task


def task_rules(vocab_size, seed):
    """The task's NUM_RULES hidden permutations of the vocabulary, fixed by the seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab_size, generator=generator) for _ in range(NUM_RULES)])


def global_batch(rules, step, batch_size, seq_len, seed):
    """The whole batch of `step` (seq_len + 1 tokens per row), a function of (seed, step) only.

    Each row picks one hidden rule and a start token and follows x[t+1] = rule[x[t]]. The first
    next token can only be guessed among NUM_RULES; after that it is exact for a model that works
    out the rule from the previous pair of tokens, which needs attention (a bigram model stays at
    ln NUM_RULES)."""
    generator = torch.Generator().manual_seed((seed * 2**32 + step) % 2**63)
    rule = rules[torch.randint(NUM_RULES, (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(rules.shape[1], (batch_size,), generator=generator)
    for t in range(seq_len):
        tokens[:, t + 1] = rule.gather(1, tokens[:, t:t + 1]).squeeze(1)
    return tokens


# ----------------------------------------------------------------------------------------- FSDP2
def shard_model(args, device, mesh):
    """Build on the meta device (no memory), shard each block and then the root with fully_shard,
    then materialize this rank's shards (to_empty) and initialize them (reset_parameters). On a
    2-D mesh (--replicate-degree > 1) fully_shard does HSDP: it shards along the mesh's second
    dimension and replicates along the first."""
    with torch.device("meta"):
        model = Transformer(**model_config(args))
    model.activation_checkpointing = args.activation_checkpointing
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": not args.no_reshard_after_forward}
    if args.mixed_precision:  # compute in bf16, reduce gradients in fp32
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    if args.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:  # each block: one all-gather in forward, one reduce-scatter after
        if args.compile:  # in place, before fully_shard, as torchtitan does: the names stay
            layer.compile(fullgraph=True)
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)  # the root: embeddings, final norm and output
    model.to_empty(device="cpu" if args.cpu_offload else device)  # offloaded shards: host memory
    model.reset_parameters()
    if args.explicit_prefetching:  # instead of FSDP2's implicit one-block-ahead prefetching
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + args.prefetch_depth])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - args.prefetch_depth):i][::-1])
    return model


def describe_sharding(model, mixed_precision):
    """Check and print what fully_shard built, read from the model: float32 DTensor parameters
    sharded Shard(0) (and replicated across the first mesh dimension under HSDP), the FSDP units
    and their prefetch plan, compiled and checkpointed blocks, bf16 under mixed precision."""
    params = list(model.parameters())
    mesh = params[0].device_mesh
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    if not all(isinstance(p, DTensor) and p.placements == placements and p.dtype == torch.float32
               for p in params):
        fail(f"fully_shard did not turn every parameter into a float32 DTensor {placements}")
    layout = f"sharded Shard(0) over {mesh.size()} ranks" if mesh.ndim == 1 else (
        f"replicated over {mesh.shape[0]} and sharded Shard(0) over {mesh.shape[1]} ranks (HSDP)")
    rank0_print(f"All {len(params)} parameters ({sum(p.numel() for p in params):,} values) are "
                f"float32 DTensors {layout}; rank 0 holds "
                f"{sum(p.to_local().numel() for p in params):,} values")
    compiled = sum(layer._compiled_call_impl is not None for layer in model.layers)  # private
    rank0_print(f"Blocks compiled: {compiled} of {len(model.layers)}; activation checkpointing: "
                f"{'every block' if model.activation_checkpointing else 'none'}")
    units = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    names = {module._get_fsdp_state(): name for name, module in units}
    for name, module in units:
        state = module._get_fsdp_state()  # private: torch 2.14 has no public getter for the plan
        group = state._fsdp_param_group
        size = sum(p.sharded_param.numel() for p in group.fsdp_params)
        reshard = group.post_forward_mesh_info is not None and module is not model  # root: never
        forward = [names[s] for s in state._states_to_forward_prefetch]
        backward = [names[s] for s in state._states_to_backward_prefetch]
        rank0_print(f"  FSDP unit {name}: {size:,} parameters, reshard after forward {reshard}, "
                    f"explicit prefetch: forward {forward}, backward {backward}")
    if mixed_precision:  # unshard as a forward would, and look at what it computes with
        for _, module in units:
            module.unshard()
        dtypes = {p.dtype for p in model.parameters()}
        for _, module in units:
            module.reshard()
        if dtypes != {torch.bfloat16}:
            fail(f"unsharded parameters are {dtypes}, not bfloat16, under --mixed-precision")
        rank0_print("Unsharded parameters are bfloat16 (gradients are reduced in float32)")


# ------------------------------------------------------------------------------------------ step
def train_step(model, optimizer, tokens, args):
    """One optimizer step on this rank's rows of the global batch; returns (global mean loss,
    gradient norm)."""
    optimizer.zero_grad()
    micro_batches = tokens.chunk(args.grad_accum_steps)
    loss_sum = torch.zeros((), device=tokens.device)
    for i, micro in enumerate(micro_batches):
        # Reduce-scatter after the last micro-batch only; until then gradients add up unsharded.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        logits = model(micro[:, :-1])
        # Scaled so that the accumulated gradient is that of the mean over all micro-batches;
        # FSDP2 then averages over the ranks: the gradient of the global batch's mean loss.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten()) / len(
            micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    # The norm of DTensor gradients is the norm of the whole (unsharded) gradient; inf: no clip.
    max_norm = args.max_norm if args.max_norm > 0 else math.inf
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    dist.all_reduce(loss_sum)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    return loss_sum.item() / dist.get_world_size(), grad_norm.item()


# ------------------------------------------------------------------------------------ checkpoint
MODEL_FILE, OPTIMIZER_FILE, MARKER_FILE = "model.pt", "optimizer.pt", "COMPLETE"


class Checkpointer:
    """Saves <checkpoint-dir>/step_000050/ checkpoints; resumes from the newest complete one.

    full: rank 0 gathers the whole state (DTensor API, or the DCP state-dict API with --dcp-api)
    and writes model.pt, a plain state dict of Transformer, and optimizer.pt, keyed by parameter
    name: plain files, but rank 0 must hold the whole state in host memory.
    sharded: every rank writes only its own shards with dcp.save (torchtitan's format), so no rank
    ever holds a full tensor. With --async-checkpoint, dcp.async_save copies the shards to host
    memory and writes them in a background thread while training goes on.
    Both resume at any world size. A checkpoint is written into step_000050.tmp; rank 0 adds the
    COMPLETE marker (the step, the model sizes, the format) last and renames it to step_000050."""

    def __init__(self, args):
        self.args, self.pending, self.error = args, None, None  # pending: an async save's future
        self.marked = threading.Event()  # rank 0 has marked the async save complete (or failed)
        # Background writes run their collectives on a process group of their own, so that they
        # never interleave with the training's (as torchtitan does).
        self.group = dist.new_group(backend="gloo") if args.async_checkpoint else None

    def save(self, model, optimizer, step):
        self.finish()  # one save at a time
        stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)  # never save it
        path = os.path.abspath(os.path.join(self.args.checkpoint_dir, f"step_{step:06d}"))
        if self.args.checkpoint_format == "full":
            model_state, optim_state = gather_full_state(model, optimizer, self.args.dcp_api)
            files = [(MODEL_FILE, model_state), (OPTIMIZER_FILE, optim_state)]
            self.mark_complete(step, path, files)
            agree_on_error(self.error)
            return path
        state = {"model": get_model_state_dict(model),  # this rank's shards, as DTensors
                 "optimizer": get_optimizer_state_dict(model, optimizer)}
        if dist.get_rank() == 0:
            shutil.rmtree(f"{path}.tmp", ignore_errors=True)  # the leftover of a crash
        dist.barrier()
        if not self.args.async_checkpoint:
            dcp.save(state, checkpoint_id=f"{path}.tmp")
            self.mark_complete(step, path)
            agree_on_error(self.error)
            return path
        self.pending = dcp.async_save(state, checkpoint_id=f"{path}.tmp", process_group=self.group)
        if dist.get_rank() == 0:  # DCP's coordinator finishes last, once every shard is written
            self.marked.clear()
            self.pending.add_done_callback(lambda done: self.mark_complete(step, path, done=done))
        return path

    def finish(self):
        """Wait for the async save in flight, if any, and for rank 0 to have marked it."""
        if self.pending:
            self.pending.exception()  # waits; a failed write is reported by mark_complete
            if dist.get_rank() == 0:
                self.marked.wait()
            self.pending = None
            agree_on_error(self.error)

    def mark_complete(self, step, path, files=(), done=None):
        """Rank 0 writes the files it holds, then the marker, then renames step_N.tmp to step_N.
        Called in the background thread for an async save: errors wait for finish()."""
        try:
            if done is not None and done.exception() is not None:  # the async write failed
                raise OSError(" ".join(str(done.exception()).split())[:300])
            if dist.get_rank() == 0:
                os.makedirs(f"{path}.tmp", exist_ok=True)
                for name, state in files:
                    torch.save(state, os.path.join(f"{path}.tmp", name))
                with open(os.path.join(f"{path}.tmp", MARKER_FILE), "w") as f:
                    json.dump({"step": step, "model": model_config(self.args),
                               "format": self.args.checkpoint_format}, f)
                shutil.rmtree(path, ignore_errors=True)  # the same step of an earlier run
                os.replace(f"{path}.tmp", path)
                rank0_print(f"Saved checkpoint {path}" + (" (in the background)" if done else ""))
        except OSError as e:
            self.error = f"cannot write checkpoint {path} ({e}); pass a writable --checkpoint-dir"
        finally:
            self.marked.set()

    def load(self, model, optimizer):
        """Resume from the newest complete checkpoint; returns its step (0: none). Rank 0 checks
        it; a full one only rank 0 reads, and the others receive the state through collectives;
        a sharded one every rank reads, taking the parts of its own shards."""
        found, full_state, error = [None], (None, None), None
        if dist.get_rank() == 0:
            path = find_checkpoint(self.args.checkpoint_dir)
            if path:
                found[0], full_state, error = read_checkpoint(path, model, self.args)
        agree_on_error(error)
        dist.broadcast_object_list(found, src=0)  # (step, path, format): all must know
        if found[0] is None:
            rank0_print(f"No checkpoint in {self.args.checkpoint_dir}: starting from step 0")
            return 0
        step, path, checkpoint_format = found[0]
        if checkpoint_format == "sharded":
            load_sharded(model, optimizer, path)
        elif self.args.dcp_api:  # DCP state-dict API: rank 0's full state, broadcast and sharded
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, full_state[0] or {}, options=options)
            set_optimizer_state_dict(model, optimizer, full_state[1] or {}, options=options)
        else:
            load_with_dtensor_api(model, optimizer, *full_state)
        rank0_print(f"Resumed from {path} at step {step}")
        return step


def gather_full_state(model, optimizer, dcp_api):
    """The full model and optimizer state on rank 0's CPU; every rank takes part in gathering it,
    and the others get empty dicts. The same result with either API."""
    if dcp_api:  # DCP state-dict API
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    # DTensor API: full_tensor() all-gathers one tensor, so every rank calls it, in the same order.
    keep = dist.get_rank() == 0
    model_state, optim_state = {}, {"state": {}, "param_groups": []}
    for name, value in model.state_dict().items():
        value = value.full_tensor()
        if keep:
            model_state[name] = value.cpu()
    names = [name for name, _ in model.named_parameters()]  # the optimizer numbers them
    for index, entries in optimizer.state_dict()["state"].items():  # step, exp_avg, exp_avg_sq
        optim_state["state"][names[index]] = {}
        for key, value in entries.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                optim_state["state"][names[index]][key] = value.cpu()
    for group in optimizer.state_dict()["param_groups"]:
        optim_state["param_groups"].append({**group, "params": [names[i] for i in group["params"]]})
    return (model_state, optim_state) if keep else ({}, {})


def load_sharded(model, optimizer, path):
    """Every rank reads the parts of the saved shards that make up its own shards: DCP reshards
    a checkpoint written at another world size or mesh."""
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    error = None
    try:
        dcp.load(state, checkpoint_id=path)  # raises on every rank if any rank fails
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        # A CheckpointException holds each failed rank's exception, with its traceback.
        cause = next(iter(e.failures.values()))[0] if hasattr(e, "failures") else e
        reason = " ".join(str(cause).split()).split(". ")[0][:200]  # its first sentence
        error = (f"cannot read checkpoint {path} ({type(cause).__name__}: {reason}); delete it to "
                 "resume from the checkpoint before it, or pass --no-resume")
    agree_on_error(error)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_with_dtensor_api(model, optimizer, model_state, optim_state):
    """Shard rank 0's full state (the other ranks pass None) into the model and the optimizer:
    distribute_tensor scatters each tensor from rank 0 as the parameter is sharded."""
    params = dict(model.named_parameters())
    sharded = {}
    for name, param in params.items():
        sharded[name] = distribute_from_rank0(model_state and model_state[name], param)
    model.load_state_dict(sharded)
    # The optimizer's hyperparameters and step counts are small: they travel as Python objects,
    # with None in place of each tensor, which is then scattered.
    layout = None
    if optim_state:
        layout = {"param_groups": optim_state["param_groups"], "state": {}}
        for name, entries in optim_state["state"].items():
            layout["state"][name] = {k: v if v.dim() == 0 else None for k, v in entries.items()}
    box = [layout]
    dist.broadcast_object_list(box, src=0)
    names, state = list(params), {}
    for name, entries in box[0]["state"].items():
        state[names.index(name)] = dict(entries)
        for key, value in entries.items():
            if value is None:
                full = optim_state and optim_state["state"][name][key]
                state[names.index(name)][key] = distribute_from_rank0(full, params[name])
    groups = [{**group, "params": [names.index(n) for n in group["params"]]}
              for group in box[0]["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def distribute_from_rank0(full, like):
    """Shard `full`, which only rank 0 holds (the others pass None), as the DTensor like is."""
    if full is None:
        full = torch.empty(like.shape, dtype=like.dtype)  # only its shape is used: rank 0 sends
    # Scattered on the mesh's device, also when --cpu-offload keeps the shards in host memory.
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements,
                             src_data_rank=0)


def find_checkpoint(root):
    """The newest step_N folder under root that holds its completion marker, or None."""
    complete, root = [], os.path.abspath(root)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not re.fullmatch(r"step_\d+", name) or not os.path.isdir(path):
            continue
        if os.path.exists(os.path.join(path, MARKER_FILE)):
            complete.append((int(name[5:]), path))
        else:
            rank0_print(f"Ignoring incomplete checkpoint {path} (no {MARKER_FILE} marker)")
    return max(complete)[1] if complete else None


def read_checkpoint(path, model, args):
    """Rank 0 reads a checkpoint's marker (and a full one's files) and checks that they fit this
    run. Returns ((step, path, format), (model state, optimizer state), None), the states None
    for a sharded checkpoint, or (None, (None, None), why not)."""
    loaded = []
    for name in (MARKER_FILE, MODEL_FILE, OPTIMIZER_FILE):
        if loaded and loaded[0].get("format", "full") == "sharded":
            break  # its shards are read by every rank in load_sharded()
        try:
            with open(os.path.join(path, name), "rb") as f:
                loaded.append(json.load(f) if name == MARKER_FILE else
                              torch.load(f, weights_only=True))
        except Exception as e:
            reason = " ".join(str(e).split())
            return None, (None, None), (
                f"cannot read checkpoint file {os.path.join(path, name)} ({reason}); delete "
                f"{path} to resume from the checkpoint before it, or pass --no-resume")
    marker, states = loaded[0], (loaded[1:] or [None, None])
    if marker.get("step") != int(os.path.basename(path)[5:]):  # edited, or copied as another
        return None, (None, None), (
            f"checkpoint {path}: its {MARKER_FILE} marker says step {marker.get('step')!r}, not "
            "its folder's; delete it to resume from the checkpoint before it, or pass --no-resume")
    if marker.get("model") != model_config(args):
        flags = [" ".join(f"--{k.replace('_', '-')} {v}" for k, v in (config or {}).items())
                 for config in (marker.get("model"), model_config(args))]
        return None, (None, None), (
            f"checkpoint {path} was written for another model ({flags[0]}) than this run's "
            f"({flags[1]}); pass its sizes, another --checkpoint-dir or --no-resume")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    try:
        fits = marker["step"] > 0
        model_state, optim_state = states
        if model_state is not None:  # a full checkpoint: its tensors must fit the model
            fits = fits and {k: v.shape for k, v in model_state.items()} == shapes
            fits = fits and set(optim_state["state"]) == set(shapes)
            for name, entries in optim_state["state"].items():
                for value in entries.values():
                    fits = fits and value.shape in (torch.Size(), shapes[name])
    except (AttributeError, KeyError, TypeError):
        fits = False
    if not fits:
        return None, (None, None), (f"checkpoint {path} does not hold this model's parameters and "
                                    "optimizer state; pass --no-resume")
    return (marker["step"], path, marker.get("format", "full")), states, None


# ------------------------------------------------------------------------------------------ main
class StepLog:
    """Keeps each step's loss and gradient norm, and every --log-every steps prints them with the
    tokens/s of the training time since the last line (checkpoint writes excluded)."""

    def __init__(self, args, start_step):
        self.args, self.first, self.losses, self.grad_norms = args, start_step + 1, [], []
        self.seconds, self.last_line = [], 0  # step times; steps when the last line was printed

    def step(self, step, loss, grad_norm, seconds):
        if not math.isfinite(loss):  # the same on every rank: it is reduced
            fail(f"training diverged: the loss of step {step} is {loss}; {DIVERGED}")
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.seconds.append(seconds)
        if step % self.args.log_every == 0 or step in (self.first, self.args.steps):
            tokens_per_s = self.tokens_per_s(self.seconds[self.last_line:])
            rank0_print(f"step {step} | loss {loss:.4f} | grad norm {grad_norm:.3f} | "
                        f"tokens/s {tokens_per_s:,.0f}")
            self.last_line = len(self.seconds)

    def tokens_per_s(self, seconds):
        tokens = len(seconds) * self.args.batch_size * self.args.seq_len
        return tokens / sum(seconds) if seconds else None


# Dense peak TFLOP/s of one GPU in (bf16, fp32), from NVIDIA's data sheets: the first name found
# in torch.cuda.get_device_name() counts. Other GPUs get no MFU.
PEAK_TFLOPS = {"H100 PCIe": (756, 51), "H100": (989, 67), "H200": (989, 67), "A100": (312, 19.5),
               "L40S": (362, 91.6), "L4": (121, 30.3)}


def flops_per_token(model, seq_len):
    """Model FLOPs of one trained token, as torchtitan counts them: 6 per parameter outside the
    embeddings (the matmuls of forward and backward) plus 12 x layers x dim x seq_len for the
    attention scores and values. Recomputation (activation checkpointing) does not count."""
    embeddings = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embeddings  # DTensors: global sizes
    return 6 * params + 12 * len(model.layers) * model.norm.weight.numel() * seq_len


def utilization(model, args, tokens_per_s, device):
    """Achieved model FLOP/s per process; on a GPU of PEAK_TFLOPS also TFLOP/s and MFU."""
    per_process = flops_per_token(model, args.seq_len) * (tokens_per_s or 0) / dist.get_world_size()
    figures = {"flops_per_token": flops_per_token(model, args.seq_len),
               "gflops_per_s": per_process / 1e9,
               "tflops_per_gpu": None, "mfu": None}
    if device.type == "cuda":
        figures["tflops_per_gpu"] = per_process / 1e12
        name = torch.cuda.get_device_name(device)
        peak = next((p for gpu, p in PEAK_TFLOPS.items() if gpu in name), None)
        if peak:
            figures["mfu"] = per_process / 1e12 / peak[0 if args.mixed_precision else 1]
    return figures


def start_afresh(args):
    """--no-resume starts from step 0 in a --checkpoint-dir that must then hold no checkpoint:
    an older run's later checkpoints would be resumed instead of this run's. --overwrite deletes
    them first (the Hugging Face convention: refuse a non-empty folder unless told to)."""
    old = sorted(glob.glob(os.path.join(args.checkpoint_dir, "step_*")))
    if not args.no_resume or not old:
        return
    if not args.overwrite:
        fail(f"--no-resume: --checkpoint-dir {args.checkpoint_dir} holds checkpoints of an earlier "
             f"run ({os.path.basename(old[-1])}...), which a later resume would mix with this "
             "run's; add --overwrite to delete them, or pass another --checkpoint-dir")
    dist.barrier()  # everyone has seen them before rank 0 deletes them
    if dist.get_rank() == 0:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        rank0_print(f"--overwrite: deleted {len(old)} checkpoint(s) of an earlier run")


def check_args(args, device, world_size):
    """Stop with one line when the flags cannot work together here."""
    if args.cpu_offload and device.type != "cuda":
        fail("--cpu-offload keeps the sharded parameters in host memory and copies them to the "
             "GPU for each use; it needs a CUDA GPU and none is in use here (drop --cpu-offload, "
             "or run on a GPU without --cpu).")
    if args.dim % args.n_heads:
        fail(f"--dim {args.dim} is not divisible by --n-heads {args.n_heads}: each head gets "
             "dim / n_heads channels; pick sizes such as --dim 64 --n-heads 4.")
    if args.batch_size % (world_size * args.grad_accum_steps):
        fail(f"--batch-size {args.batch_size} (the global batch) is not divisible by world size "
             f"{world_size} x --grad-accum-steps {args.grad_accum_steps}; use a multiple of "
             f"{world_size * args.grad_accum_steps}.")
    if world_size % args.replicate_degree:
        fail(f"--replicate-degree {args.replicate_degree} does not divide the world size "
             f"{world_size}: HSDP needs replicas of world size / R ranks each.")
    if args.async_checkpoint and args.checkpoint_format != "sharded":
        fail("--async-checkpoint writes sharded checkpoints in the background; add "
             "--checkpoint-format sharded")
    if args.mixed_precision and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        fail("--mixed-precision computes in bfloat16, which this GPU does not support; drop it.")
    if args.compile:  # fail now, in one line, rather than at the first step
        try:
            torch.compile(lambda x: x * 2 + 1)(torch.ones(2, device=device))
        except Exception as e:
            fail(f"--compile: torch.compile cannot build code here ({str(e).strip()[:200]}); "
                 "install a C++ compiler (CPU) or Triton (GPU), or drop --compile")


def main(args, device):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_args(args, device, world_size)
    torch.manual_seed(args.seed)  # the model's initialization; the data has its own generator
    check_outputs(args, {"--checkpoint-dir": args.checkpoint_dir})
    if args.checkpoint_dir:
        lock_folder("--checkpoint-dir", args.checkpoint_dir)
        start_afresh(args)

    # HSDP with --replicate-degree R: R replicas, each sharded over world size / R ranks.
    if args.replicate_degree > 1:
        shape = (args.replicate_degree, world_size // args.replicate_degree)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,))
    model = shard_model(args, device, mesh)
    describe_sharding(model, args.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after sharding: DTensors
    checkpointer = Checkpointer(args)
    resume = args.checkpoint_dir and not args.no_resume
    start_step = checkpointer.load(model, optimizer) if resume else 0
    if start_step >= args.steps:
        rank0_print(f"The checkpoint is at step {start_step}, --steps is {args.steps}: no training")
    rules, rows = task_rules(args.vocab_size, args.seed), args.batch_size // world_size
    report, log, checkpoint = Report(args, device), StepLog(args, start_step), None
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        if args.explicit_prefetching:
            model.unshard()  # start the root's all-gather before the data is ready
        tokens = global_batch(rules, step, args.batch_size, args.seq_len, args.seed)
        tokens = tokens[rank * rows:(rank + 1) * rows].to(device)  # this rank's rows
        loss, grad_norm = train_step(model, optimizer, tokens, args)
        log.step(step, loss, grad_norm, time.perf_counter() - started)
        if args.checkpoint_dir and (step % args.save_every == 0 or step == args.steps):
            checkpoint = checkpointer.save(model, optimizer, step)
    checkpointer.finish()  # an async save still in flight
    tokens_per_s = log.tokens_per_s(log.seconds)
    figures = utilization(model, args, tokens_per_s, device)
    if log.losses:
        rank0_print(f"Trained steps {start_step + 1}-{args.steps}: final loss {log.losses[-1]:.4f}"
                    f" (ln(vocab) = {math.log(args.vocab_size):.4f}), {tokens_per_s:,.0f} tokens/s"
                    + (f", {figures['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU "
                       f"{figures['mfu']:.1%}" if figures["mfu"] is not None else
                       f", {figures['gflops_per_s']:,.1f} GFLOP/s per process"))
    report.training_done(model, optimizer)
    report.write(train_loss=log.losses[-1] if log.losses else None, losses=log.losses,
                 grad_norms=log.grad_norms, first_step=start_step + 1,
                 step=max(start_step, args.steps), tokens_per_s=tokens_per_s, checkpoint=checkpoint,
                 **figures)


# What the plumbing's one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or clip the gradients with --max-norm"
MEMORY_ADVICE = ("use a smaller --batch-size (or more --grad-accum-steps), --seq-len, --dim, "
                 "--n-layers or --vocab-size, or --activation-checkpointing")


def parse_args():
    parser = RankZeroArgumentParser(
        description="FSDP2 (fully_shard) training of a small causal Transformer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--vocab-size", type=positive(int), default=128, metavar="N", help="vocabulary size")
    add("--dim", type=positive(int), default=64, metavar="N", help="model width")
    add("--n-layers", type=positive(int), default=2, metavar="N", help="Transformer blocks")
    add("--n-heads", type=positive(int), default=4, metavar="N", help="heads (must divide --dim)")
    add("--seq-len", type=positive(int), default=32, metavar="N", help="tokens per sequence")
    add("--batch-size", type=positive(int), default=32, metavar="N", help="global batch")
    add("--steps", type=positive(int), default=200, metavar="N", help="optimizer steps to train to")
    add("--lr", type=positive(float, most=1e30), default=3e-3, metavar="LR",
        help="AdamW learning rate, at most 1e30 (much larger ones overflow float32)")
    add("--seed", type=positive(int, zero=True, most=2**32 - 1), default=0, metavar="S",
        help="random seed (model init and the data)")
    add("--cpu", action="store_true", help="CPU and gloo even if there are GPUs")
    add("--explicit-prefetching", action="store_true", help="each block all-gathers the next "
        "--prefetch-depth ones in forward and backward; each step starts the root's all-gather")
    add("--prefetch-depth", type=positive(int), default=2, metavar="N", help="blocks to prefetch")
    add("--mixed-precision", action="store_true", help="compute in bfloat16, reduce gradients in "
        "float32 (the sharded parameters and optimizer state stay float32)")
    add("--max-norm", type=positive(float, zero=True), default=1.0, metavar="X",
        help="clip gradients (0: do not)")
    add("--no-reshard-after-forward", action="store_true",
        help="keep parameters gathered from forward to backward (FSDP1's SHARD_GRAD_OP, ZeRO-2)")
    add("--cpu-offload", action="store_true", help="shards and optimizer step on the host (GPU)")
    add("--grad-accum-steps", type=positive(int), default=1, metavar="K",
        help="split each rank's batch into K micro-batches; gradients are reduced after the last")
    add("--dcp-api", action="store_true", help="full checkpoints with the DCP state-dict API, "
        "not DTensor's full_tensor/distribute_tensor (the same files either way)")
    add("--checkpoint-format", default="full", choices=["full", "sharded"],
        help="full: rank 0 gathers and writes plain model.pt/optimizer.pt; sharded: every rank "
             "writes its own shards with DCP (torchtitan: --checkpoint.enable); both resume at "
             "any world size")
    add("--async-checkpoint", action="store_true", help="write sharded checkpoints in the "
        "background with dcp.async_save (torchtitan: --checkpoint.async_mode async)")
    add("--replicate-degree", type=positive(int), default=1, metavar="R",
        help="HSDP: R replicas, each sharded over world size / R ranks, on a 2-D mesh "
             "(torchtitan: --parallelism.data_parallel_replicate_degree)")
    add("--activation-checkpointing", action="store_true", help="recompute each block's "
        "activations in backward (torchtitan: activation checkpointing mode full)")
    add("--compile", action="store_true", help="torch.compile each block before sharding it "
        "(torchtitan: --compile.enable)")
    add("--checkpoint-dir", metavar="DIR", help="save to DIR/step_N, resume from the newest there")
    add("--save-every", type=positive(int), default=50, metavar="N", help="save every N steps "
        "and at the last")
    add("--no-resume", action="store_true", help="start at step 0 in a --checkpoint-dir that holds "
        "no checkpoint (or with --overwrite)")
    add("--overwrite", action="store_true", help="with --no-resume, delete the checkpoints "
        "already in --checkpoint-dir")
    add("--log-every", type=positive(int), default=10, metavar="N", help="print every N steps")
    add("--world-size", type=positive(int), metavar="N", help="processes to start without "
        "torchrun (None: one per GPU, or 2 on CPU)")
    add("--dist-timeout", type=positive(float), default=600, metavar="S", help="seconds to wait "
        "for a lost or hung peer before the job fails (longer than a checkpoint write)")
    add("--metrics-json", metavar="PATH", help="write the final metrics to PATH (rank 0)")
    return parser.parse_args()


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
