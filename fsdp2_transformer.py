"""FSDP2 (fully_shard) training of a small causal Transformer, on GPUs or on CPU.

A working version of the PyTorch FSDP2 guide: the model is built on the meta device, sharded with
`fully_shard` block by block and then at the root, materialized with `to_empty` + `reset_parameters`,
and trained on a synthetic next-token task, with the guide's options as flags (explicit prefetching,
mixed precision, gradient clipping, resharding, CPU offload, DTensor or DCP checkpoints) plus gradient
accumulation and checkpoints that resume.

Launch it with torchrun:
    torchrun --nproc_per_node 2 fsdp2_transformer.py                     # 2 CPU processes without GPUs
    torchrun --nproc_per_node 8 fsdp2_transformer.py --explicit-prefetching --mixed-precision
    torchrun --nproc_per_node 2 fsdp2_transformer.py --checkpoint-dir ckpt --save-every 50 --dcp-api
    torchrun --nproc_per_node 2 --max-restarts 3 fsdp2_transformer.py --checkpoint-dir ckpt  # restarts resume
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        fsdp2_transformer.py --dim 1024 --n-layers 16 --n-heads 16 --batch-size 256

CUDA + NCCL are used when a GPU is visible, CPU + gloo otherwise (or with --cpu). --batch-size is
the global batch: it is split over the ranks, so every world size trains on the same data.
"""
import argparse
import datetime
import gc
import json
import math
import os
import re
import resource
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

MODEL_FILE, OPTIMIZER_FILE, MARKER_FILE = "model.pt", "optimizer.pt", "COMPLETE"
NUM_RULES = 4  # hidden permutations of the synthetic task


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


# ---------------------------------------------------------------------------------------------- model

@torch.no_grad()
def init_(param, fill):
    """Initialize `param` (a plain tensor or an FSDP2 DTensor shard) with fill(full tensor).

    Every rank draws the full tensor from the same CPU generator and keeps its own shard, so the model
    is the same whatever the world size. (DTensor's own random ops do that only on CUDA; on a CPU mesh
    every rank draws the same numbers for its shard, which repeats rows and depends on the world size.)
    """
    full = fill(torch.empty(param.shape, dtype=param.dtype))
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)  # no communication
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
        # No bias: a key bias cannot change softmax attention, so its gradient is zero and Adam would only
        # turn rounding noise into updates of it.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # position t sees positions <= t only
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
        self.reset_parameters()  # a no-op on the meta device; after to_empty, call it again

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

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


# ----------------------------------------------------------------------------------------------- data

def task_rules(vocab_size, seed):
    """The task's NUM_RULES hidden permutations of the vocabulary, fixed by the seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab_size, generator=generator) for _ in range(NUM_RULES)])


def global_batch(rules, step, batch_size, seq_len, seed):
    """The whole batch of `step` (seq_len + 1 tokens per row), a function of (seed, step) only.

    Each row picks one hidden rule and a start token and follows x[t+1] = rule[x[t]]. The first next
    token can only be guessed among NUM_RULES; after that it is exact for a model that works out the
    rule from the previous pair of tokens, which needs attention (a bigram model stays at ln NUM_RULES).
    """
    generator = torch.Generator().manual_seed((seed * 2**32 + step) % 2**63)
    rule = rules[torch.randint(NUM_RULES, (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(rules.shape[1], (batch_size,), generator=generator)
    for t in range(seq_len):
        tokens[:, t + 1] = rule.gather(1, tokens[:, t:t + 1]).squeeze(1)
    return tokens


# ----------------------------------------------------------------------------------------------- FSDP2

def build_model(args, device, mesh):
    """Build on the meta device, shard each block and then the root, then materialize and initialize."""
    with torch.device("meta"):
        model = Transformer(**model_config(args))
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": not args.no_reshard_after_forward}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    model.to_empty(device="cpu" if args.cpu_offload else device)  # offloaded shards live in host memory
    model.reset_parameters()
    if args.explicit_prefetching:
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + args.prefetch_depth])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - args.prefetch_depth):i][::-1])
    return model


def check_sharding(model, mixed_precision):
    """Rank 0 reports what FSDP2 made of the parameters; stops the run if it is not what we asked for."""
    params = list(model.parameters())
    sharded = all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.dtype == torch.float32 for p in params)
    if not sharded:
        fail("fully_shard did not turn every parameter into a float32 DTensor sharded Shard(0)")
    shard = sum(p.to_local().numel() for p in params)
    rank0_print(f"All {len(params)} parameters ({sum(p.numel() for p in params):,} values) are float32 DTensors "
                f"sharded Shard(0); rank 0 holds {shard:,} values")
    if mixed_precision:
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for module in fsdp_modules:
            module.unshard()
        dtypes = {p.dtype for p in model.parameters()}
        for module in fsdp_modules:
            module.reshard()
        if dtypes != {torch.bfloat16}:
            fail(f"unsharded parameters are {dtypes}, not bfloat16, under --mixed-precision")
        rank0_print("Unsharded parameters are bfloat16 (gradients are reduced in float32)")


# ---------------------------------------------------------------------------------------------- training

def train_step(model, optimizer, tokens, args):
    """One optimizer step on this rank's rows of the global batch; returns (global mean loss, gradient norm)."""
    optimizer.zero_grad()
    micro_batches = tokens.chunk(args.grad_accum_steps)
    loss_sum = torch.zeros((), device=tokens.device)
    for i, micro in enumerate(micro_batches):
        # Reduce-scatter the gradients only after the last micro-batch; until then they accumulate unsharded.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        logits = model(micro[:, :-1])
        # Scaled so that the accumulated gradient is that of the mean over all micro-batches; FSDP2 then
        # averages over the ranks, which gives the gradient of the global batch's mean loss.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten()) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    # The norm of DTensor gradients is the norm of the whole (unsharded) gradient; inf: no clipping.
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_norm if args.max_norm > 0 else math.inf)
    optimizer.step()
    dist.all_reduce(loss_sum)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    return loss_sum.item() / dist.get_world_size(), grad_norm.item()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def train_state_bytes(model, optimizer):
    """Bytes this rank holds in parameters, gradients and optimizer state (its local shards)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def max_over_ranks(value, device):
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ---------------------------------------------------------------------------------------------- checkpoints
# <checkpoint-dir>/step_000050/{model.pt, optimizer.pt, COMPLETE}: full (unsharded) tensors, so any world
# size can resume. model.pt is a plain state dict of Transformer; optimizer.pt is the optimizer state keyed
# by parameter name (the DCP full state dict format, whichever API wrote it); COMPLETE, written last, holds
# the step and the model sizes. A checkpoint is written as step_000050.tmp and renamed when complete.

def gather_with_dtensor_api(model, optimizer):
    """Full tensors from the DTensor shards (every rank takes part); only rank 0 keeps them, on CPU."""
    keep = dist.get_rank() == 0

    def full(value):  # full_tensor() is a collective: every rank calls it, in the same order
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return None if not keep else value.cpu() if torch.is_tensor(value) else value

    names = [name for name, _ in model.named_parameters()]
    model_sd = {name: full(value) for name, value in model.state_dict().items()}
    sd = optimizer.state_dict()
    optim_sd = {"state": {names[i]: {k: full(v) for k, v in state.items()} for i, state in sd["state"].items()},
                "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                 for group in sd["param_groups"]]}
    return model_sd, optim_sd


def write_checkpoint(path, step, model_sd, optim_sd, args):
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch.save(model_sd, os.path.join(tmp, MODEL_FILE))
    torch.save(optim_sd, os.path.join(tmp, OPTIMIZER_FILE))
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
        json.dump({"step": step, "model": model_config(args), "api": "dcp" if args.dcp_api else "dtensor"}, f)
    shutil.rmtree(path, ignore_errors=True)  # the same step from an earlier run (--no-resume)
    os.replace(tmp, path)


def save_checkpoint(model, optimizer, step, args):
    if args.dcp_api:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, on CPU
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    else:
        model_sd, optim_sd = gather_with_dtensor_api(model, optimizer)
    path = os.path.abspath(os.path.join(args.checkpoint_dir, f"step_{step:06d}"))
    error = None
    if dist.get_rank() == 0:
        try:
            write_checkpoint(path, step, model_sd, optim_sd, args)
        except OSError as e:
            error = f"cannot write checkpoint {path} ({e}); pass a writable --checkpoint-dir"
    agree_on_error(error)
    rank0_print(f"Saved checkpoint {path}")
    return path


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


def as_flags(config):
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (config or {}).items())


def read_checkpoint(path, model, args):
    """Read and check a checkpoint's files; returns ((step, model state, optimizer state), error)."""
    loaded = {}
    for name in (MARKER_FILE, MODEL_FILE, OPTIMIZER_FILE):
        file = os.path.join(path, name)
        try:
            if name == MARKER_FILE:
                with open(file) as f:
                    loaded[name] = json.load(f)
                int(loaded[name]["step"])
            else:
                loaded[name] = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            return None, (f"cannot read checkpoint file {file} ({reason}); delete {path} to resume from the "
                          "checkpoint before it, or pass --no-resume")
    marker, model_sd, optim_sd = loaded[MARKER_FILE], loaded[MODEL_FILE], loaded[OPTIMIZER_FILE]
    if marker.get("model") != model_config(args):
        return None, (f"checkpoint {path} was written for another model ({as_flags(marker.get('model'))}) than "
                      f"this run's ({as_flags(model_config(args))}); pass its sizes, another --checkpoint-dir or "
                      "--no-resume")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    try:
        fits = ({k: v.shape for k, v in model_sd.items()} == shapes and set(optim_sd["state"]) == set(shapes)
                and all(v.shape in (torch.Size(), shapes[name])
                        for name, state in optim_sd["state"].items() for v in state.values()))
    except (AttributeError, KeyError, TypeError):
        fits = False
    if not fits:
        return None, f"checkpoint {path} does not hold this model's parameters and optimizer state; pass --no-resume"
    return (marker["step"], model_sd, optim_sd), None


def distribute_from_rank0(full, like):
    """Shard `full`, which only rank 0 holds (the others pass None), as the DTensor `like` is sharded."""
    if full is None:
        full = torch.empty(like.shape, dtype=like.dtype)  # only its shape matters: rank 0 scatters the data
    # Scattered on the mesh's device, also when --cpu-offload keeps the shards in host memory.
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=0)


def load_with_dtensor_api(model, optimizer, model_sd, optim_sd):
    params = dict(model.named_parameters())
    model.load_state_dict({name: distribute_from_rank0(model_sd.get(name), p) for name, p in params.items()})
    # Hyperparameters and the scalar step counts travel as objects; the full tensors are scattered as DTensors.
    box = [None]
    if optim_sd:
        box = [{"param_groups": optim_sd["param_groups"],
                "state": {name: {k: v if v.dim() == 0 else None for k, v in state.items()}
                          for name, state in optim_sd["state"].items()}}]
    dist.broadcast_object_list(box, src=0)
    index = {name: i for i, name in enumerate(params)}
    state = {index[name]: {k: distribute_from_rank0(optim_sd["state"][name][k] if optim_sd else None, params[name])
                           if v is None else v for k, v in scalars.items()}
             for name, scalars in box[0]["state"].items()}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in box[0]["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_checkpoint(model, optimizer, args):
    """Resume from the newest complete checkpoint in --checkpoint-dir; returns its step (0: none).

    Only rank 0 reads the files: it checks them, then the state reaches the other ranks through collectives
    (DCP: broadcast_from_rank0; DTensor API: distribute_tensor from rank 0).
    """
    path, found, error = None, None, None
    if dist.get_rank() == 0:
        path = find_checkpoint(args.checkpoint_dir)
        if path:
            found, error = read_checkpoint(path, model, args)
    agree_on_error(error)
    box = [found[0] if found else 0]
    dist.broadcast_object_list(box, src=0)
    if box[0] == 0:
        rank0_print(f"No checkpoint in {args.checkpoint_dir}: starting from step 0")
        return 0
    model_sd, optim_sd = found[1:] if found else ({}, {})
    if args.dcp_api:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, model_sd, options=options)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    else:
        load_with_dtensor_api(model, optimizer, model_sd, optim_sd)
    rank0_print(f"Resumed from {path} at step {box[0]}")
    return box[0]


# ---------------------------------------------------------------------------------------------- main

def train(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics_dir = args.metrics_json and os.path.dirname(os.path.abspath(args.metrics_json))
    outputs = {"--checkpoint-dir": args.checkpoint_dir and os.path.abspath(args.checkpoint_dir),
               "--metrics-json": metrics_dir}
    agree_on_error(output_error(outputs) if rank == 0 else None)
    model = build_model(args, device, init_device_mesh(device.type, (world_size,)))
    check_sharding(model, args.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after fully_shard: it sees the DTensors
    start_step = load_checkpoint(model, optimizer, args) if args.checkpoint_dir and not args.no_resume else 0
    if start_step >= args.steps:
        rank0_print(f"The checkpoint is at step {start_step}, --steps is {args.steps}: nothing to train")

    rules = task_rules(args.vocab_size, args.seed)
    rows = args.batch_size // world_size
    tokens_per_step = args.batch_size * args.seq_len
    losses, grad_norms, state_bytes, checkpoint, train_s = [], [], None, None, 0.0
    logged = (start_step, 0.0)  # step and training time at the last printed line
    start = time.perf_counter()
    for step in range(start_step + 1, args.steps + 1):
        step_start = time.perf_counter()
        if args.explicit_prefetching:
            model.unshard()  # start the root's all-gather before the data is ready
        tokens = global_batch(rules, step, args.batch_size, args.seq_len, args.seed)[rank * rows:(rank + 1) * rows]
        loss, grad_norm = train_step(model, optimizer, tokens.to(device), args)
        train_s += time.perf_counter() - step_start
        losses.append(loss)
        grad_norms.append(grad_norm)
        if state_bytes is None:  # sizes are fixed from the first optimizer step on
            state_bytes = max_over_ranks(train_state_bytes(model, optimizer), device)
        if step % args.log_every == 0 or step in (start_step + 1, args.steps):
            tokens_per_s = (step - logged[0]) * tokens_per_step / (train_s - logged[1])
            rank0_print(f"step {step} | loss {loss:.4f} | grad norm {grad_norm:.3f} | tokens/s {tokens_per_s:,.0f}")
            logged = (step, train_s)
        if args.checkpoint_dir and (step % args.save_every == 0 or step == args.steps):
            checkpoint = save_checkpoint(model, optimizer, step, args)
    wall_s = time.perf_counter() - start

    use_cuda = device.type == "cuda"
    peak = (torch.cuda.max_memory_allocated(device) if use_cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # ru_maxrss is in KiB
    peak = max_over_ranks(peak, device)
    tokens_per_s = len(losses) * tokens_per_step / train_s if losses else None
    if losses:
        rank0_print(f"Trained steps {start_step + 1}-{args.steps} in {wall_s:.1f}s: final loss {losses[-1]:.4f} "
                    f"(ln(vocab) = {math.log(args.vocab_size):.4f}), {tokens_per_s:,.0f} tokens/s; per rank: peak "
                    f"memory ({'CUDA allocated' if use_cuda else 'process RSS'}) {peak / 2**20:.1f} MB, "
                    f"parameters + gradients + optimizer state {state_bytes / 2**20:.2f} MB")
    if args.metrics_json and rank == 0:
        metrics = {
            "script": os.path.basename(__file__), "world_size": world_size, "device": device.type,
            "backend": dist.get_backend(), "train_loss": losses[-1] if losses else None, "losses": losses,
            "grad_norms": grad_norms, "first_step": start_step + 1, "step": max(start_step, args.steps),
            "wall_s": wall_s, "tokens_per_s": tokens_per_s, "train_state_bytes": state_bytes,
            "peak_memory_bytes": peak, "checkpoint": checkpoint,
        }
        tmp = f"{args.metrics_json}.tmp"
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=2)
        os.replace(tmp, args.metrics_json)


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
    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.cpu_offload and not use_cuda:
        fail("--cpu-offload keeps the sharded parameters in host memory and copies them to the GPU for each use; "
             "it needs a CUDA GPU and none is in use here (drop --cpu-offload, or run on a GPU without --cpu).")
    if args.dim % args.n_heads:
        fail(f"--dim {args.dim} is not divisible by --n-heads {args.n_heads}: each head gets dim / n_heads "
             "channels; pick sizes such as --dim 64 --n-heads 4.")
    if args.batch_size % (world_size * args.grad_accum_steps):
        fail(f"--batch-size {args.batch_size} (the global batch) is not divisible by world size {world_size} x "
             f"--grad-accum-steps {args.grad_accum_steps}; use a multiple of {world_size * args.grad_accum_steps}.")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda and local_world_size > torch.cuda.device_count():
        fail(f"{local_world_size} processes on this node but {torch.cuda.device_count()} GPUs visible; start at most "
             "one process per GPU (torchrun --nproc_per_node).", node_local=True)
    if args.mixed_precision and use_cuda and not torch.cuda.is_bf16_supported():
        fail("--mixed-precision computes in bfloat16, which this GPU does not support; drop --mixed-precision.")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the model's initialization; the data has its own generator

    try:
        # A collective that waits longer than --dist-timeout for a peer fails the job instead of hanging it.
        init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.dist_timeout))
        train(args, device)  # its model and optimizer are garbage once it returns
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
        # FSDP's modules keep the process group alive through reference cycles. Free them now, while the
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
    parser = RankZeroArgumentParser(description="FSDP2 (fully_shard) training of a small causal Transformer",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab-size", type=positive_int, default=128, metavar="N", help="vocabulary size")
    parser.add_argument("--dim", type=positive_int, default=64, metavar="N", help="model width")
    parser.add_argument("--n-layers", type=positive_int, default=2, metavar="N", help="Transformer blocks")
    parser.add_argument("--n-heads", type=positive_int, default=4, metavar="N", help="attention heads (divide --dim)")
    parser.add_argument("--seq-len", type=positive_int, default=32, metavar="N", help="tokens per sequence")
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                        help="global batch (sequences per step, split over ranks and micro-batches)")
    parser.add_argument("--steps", type=positive_int, default=200, metavar="N", help="optimizer steps to train to")
    parser.add_argument("--lr", type=float, default=3e-3, metavar="LR", help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (model init and the data)")
    parser.add_argument("--cpu", action="store_true", help="train on CPU with gloo even when GPUs are present")
    parser.add_argument("--explicit-prefetching", action="store_true",
                        help="all-gather the next --prefetch-depth blocks explicitly in forward and backward, and "
                             "start the root's all-gather before each step's data is made")
    parser.add_argument("--prefetch-depth", type=positive_int, default=2, metavar="N",
                        help="blocks to prefetch with --explicit-prefetching")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="compute with bfloat16 parameters, reduce gradients in float32 (sharded parameters and "
                             "optimizer state stay float32)")
    parser.add_argument("--max-norm", type=float, default=1.0, metavar="X",
                        help="clip the gradient norm to X (0: no clipping)")
    parser.add_argument("--no-reshard-after-forward", action="store_true",
                        help="keep parameters gathered from forward to backward (FSDP1's SHARD_GRAD_OP, ZeRO-2)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep sharded parameters, gradients and optimizer step in host memory (needs a GPU)")
    parser.add_argument("--grad-accum-steps", type=positive_int, default=1, metavar="K",
                        help="split each rank's batch into K micro-batches; gradients are reduced after the last")
    parser.add_argument("--dcp-api", action="store_true",
                        help="checkpoint with the DCP state-dict API (get/set_model_state_dict) instead of DTensor "
                             "full_tensor/distribute_tensor; the files are the same either way")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="save checkpoints to DIR/step_NNNNNN and resume from the newest complete one")
    parser.add_argument("--save-every", type=positive_int, default=50, metavar="N",
                        help="save a checkpoint every N steps, and at the last step (with --checkpoint-dir)")
    parser.add_argument("--no-resume", action="store_true", help="start from step 0 even if --checkpoint-dir has one")
    parser.add_argument("--log-every", type=positive_int, default=10, metavar="N", help="print every N steps")
    parser.add_argument("--dist-timeout", type=positive_float, default=600, metavar="S",
                        help="seconds a collective waits for the other ranks before the job fails (a lost or hung "
                             "peer); must exceed the longest pause of one rank, such as a checkpoint write")
    parser.add_argument("--metrics-json", default=None, metavar="PATH", help="write final metrics to PATH (rank 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # started with python: one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    main(args)
