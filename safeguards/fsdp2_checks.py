"""fsdp2_transformer.py's checks, each a function that returns the line to stop with, or None:
flags that cannot work together here, sizes that do not split over the ranks, and what
fully_shard (and parallelize_module) built."""
import importlib.util
import math
import os

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .errors import rank0_print
from .flags import compile_problem
from .replica_groups import fault_tolerance_problem

# What the one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or clip the gradients with --max-norm"
MEMORY_ADVICE = ("use a smaller --batch-size (or more --grad-accum-steps), --seq-len, --dim, "
                 "--n-layers or --vocab-size, or --activation-checkpointing")


def flag_problem(args, device, world_size):
    """Why these flags cannot work together on this device and world size, or None: every check
    of fsdp2_transformer.py's flags in one place."""
    if args.cpu_offload and device.type != "cuda":
        return ("--cpu-offload keeps the sharded parameters in host memory and copies them to the "
                "GPU for each use; it needs a CUDA GPU and none is in use here (drop "
                "--cpu-offload, or run on a GPU without --cpu).")
    if args.cpu_offload and args.tp_degree > 1:
        return ("--cpu-offload with --tp-degree: FSDP2's CPU offload under tensor parallel is not "
                "tested in this script (its GPU tests use one GPU); drop --cpu-offload (tensor "
                "parallel divides each rank's state by T too), or --tp-degree.")
    problem = sizes_problem(args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if problem or (problem := fault_tolerance_problem(args, world_size)):
        return problem
    if args.pad_documents and not args.pack_documents:
        return ("--pad-documents puts one document of --pack-documents' task in each row; add "
                "--pack-documents")
    if args.pack_documents and args.seq_len < 2:
        return (f"--pack-documents with --seq-len {args.seq_len}: a document needs 2 tokens to "
                "have a next one to learn; use --seq-len 2 or more")
    if args.async_checkpoint and args.checkpoint_format != "sharded":
        return ("--async-checkpoint writes sharded checkpoints in the background; add "
                "--checkpoint-format sharded")
    unused = [flag for flag, given in (("--dcp-api", args.dcp_api), ("--overwrite", args.overwrite),
                                       ("--checkpoint-format sharded",
                                        args.checkpoint_format == "sharded"))
              if given and not args.checkpoint_dir]
    if unused:
        return (f"{unused[0]} says how to save checkpoints, but without --checkpoint-dir none is "
                "saved; add --checkpoint-dir DIR, or drop it")
    if args.mixed_precision and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "--mixed-precision computes in bfloat16, which this GPU does not support; drop it."
    if args.float8 and (problem := float8_problem(args, device, world_size)):
        return problem
    return compile_problem(device) if args.compile else None


def sizes_problem(args, world_size, ranks_per_node):
    """Why these sizes and degrees cannot train at this world size, or None (also --plan's check).
    ranks_per_node: the processes of one node (torchrun's --nproc_per_node)."""
    tp, replicas, heads = args.tp_degree, args.replicate_degree, args.n_heads
    if args.dim % heads:
        return (f"--dim {args.dim} is not divisible by --n-heads {heads}: each head gets dim / "
                "n_heads channels; pick sizes such as --dim 64 --n-heads 4.")
    if world_size % tp or ranks_per_node % tp:
        return (f"--tp-degree {tp} does not divide the world size {world_size} and the "
                f"{ranks_per_node} processes per node: the T ranks of a tensor parallel group "
                "sit on one node, whose links carry their collectives in every layer; use a "
                f"divisor of {math.gcd(world_size, ranks_per_node)}.")
    for flag, size, part in (("--n-heads", heads, "heads (and dim / T channels of q, k, v; "
                              "4 x dim / T of the MLP)"),
                             ("--seq-len", args.seq_len, "positions of the residual stream "
                              "(sequence parallel)"),
                             ("--vocab-size", args.vocab_size, "rows of the embedding and the "
                              "output head")):
        if size % tp:
            return (f"{flag} {size} is not divisible by --tp-degree {tp}: each tensor parallel "
                    f"rank holds {flag[2:].replace('-', ' ')} / T {part}; pick a multiple of "
                    f"{tp}.")
    dp = world_size // tp  # the data-parallel ranks: each reads its rows of the global batch
    ranks = f"world size {world_size}" + (f" / --tp-degree {tp}" if tp > 1 else "")
    if args.batch_size % (dp * args.grad_accum_steps):
        return (f"--batch-size {args.batch_size} (the global batch) is not divisible by {ranks} x "
                f"--grad-accum-steps {args.grad_accum_steps}; use a multiple of "
                f"{dp * args.grad_accum_steps}.")
    if dp % replicas:
        return (f"--replicate-degree {replicas} does not divide the {ranks}: HSDP needs replicas "
                f"of {ranks} / R ranks each.")
    return None


def float8_problem(args, device, world_size):
    """Why --float8 cannot train here, or None."""
    flag = f"--float8 {args.float8}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU is in use"
        return (f"{flag} multiplies in float8, which needs an NVIDIA GPU of compute capability "
                f"8.9 or later (H100, H200, L4, RTX 4090); {where} here: drop --float8")
    if importlib.util.find_spec("torchao") is None:
        return f"{flag} trains with torchao's float8 layers; install it: pip install torchao"
    if args.tp_degree > 1:
        return (f"{flag} with --tp-degree: torchao's float8 layers need tensor parallel plans of "
                "their own (Float8ColwiseParallel), not this script's; drop one of them")
    if not args.mixed_precision:
        return (f"{flag} speeds up bf16 training: add --mixed-precision (the rest of the model "
                "then computes in bfloat16)")
    rows = args.batch_size // (world_size * args.grad_accum_steps)  # a micro-batch's, per rank
    if args.dim % 16 or rows * args.seq_len % 16:
        return (f"{flag}: float8 matmuls need every size to be a multiple of 16, and --dim "
                f"{args.dim} or a micro-batch's {rows} x {args.seq_len} tokens per rank is not; "
                "pick multiples of 16")
    return None


def sharding_problem(model, mixed_precision):
    """What fully_shard (and parallelize_module) built, checked with public calls: every parameter
    a float32 DTensor of the whole mesh, sharded along dim 0 over "dp" (HSDP: replicated over
    "replicate", sharded over "shard"); with tensor parallel, the weight of every linear and
    embedding split over "tp" and the rest replicated or split there as the plan says (norms
    replicated); unsharded to bf16 under mixed precision. Prints it, or returns what is wrong."""
    params = dict(model.named_parameters())
    mesh = next(iter(params.values())).device_mesh
    split = {f"{name}.weight" for name, module in model.named_modules()
             if isinstance(module, (nn.Linear, nn.Embedding))}
    norms = {f"{name}.{kind}" for name, module in model.named_modules()
             if isinstance(module, nn.LayerNorm) for kind in ("weight", "bias")}
    for name, p in params.items():
        if not (isinstance(p, DTensor) and p.dtype == torch.float32 and p.device_mesh == mesh):
            return f"{name} is not a float32 DTensor of the {mesh.mesh_dim_names} mesh"
        for dim, placement in zip(mesh.mesh_dim_names, p.placements):
            sharded = getattr(placement, "dim", None) is not None  # Shard, or FSDP2's on TP's
            if dim == "tp" and name in split | norms and sharded != (name in split):
                return f"{name} is {'' if sharded else 'not '}split over the tp mesh dimension"
            if dim != "tp" and (not placement.is_replicate() if dim == "replicate"
                                else getattr(placement, "dim", None) != 0):
                return f"{name} is {placement} over mesh dimension {dim}, not as FSDP2 shards"
    ranks = {dim: f"{n} rank{'s' * (n != 1)}" for dim, n in zip(mesh.mesh_dim_names, mesh.shape)}
    layout = f"sharded Shard(0) over {ranks.get('dp') or ranks['shard']}"
    if "replicate" in ranks:
        layout = f"replicated over {ranks['replicate']} and {layout} (HSDP)"
    if "tp" in ranks:
        tp_split = sum(getattr(p.placements[-1], "dim", None) is not None for p in params.values())
        layout += (f", tensor parallel over {ranks['tp']} ({tp_split} split, "
                   f"{len(params) - tp_split} replicated)")
    rank0_print(f"All {len(params)} parameters ({sum(p.numel() for p in params.values()):,} "
                f"values) are float32 DTensors {layout}; rank 0 holds "
                f"{sum(p.to_local().numel() for p in params.values()):,} values")
    if mixed_precision:
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        dtypes = {p.dtype for p in model.parameters()}
        for unit in units:
            unit.reshard()
        if dtypes != {torch.bfloat16}:
            return f"unsharded parameters are {dtypes}, not bfloat16, under --mixed-precision"
        rank0_print("Unsharded parameters are bfloat16 (gradients are reduced in float32)")
    return None
