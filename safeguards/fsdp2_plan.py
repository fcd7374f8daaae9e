"""fsdp2_transformer.py --plan: each rank's memory predicted from the model built on the meta
device, before anything is allocated. tests/test_fsdp2_scale.py holds it against measured runs
(the training state exactly, the saved activations); the peaks of a 1B model on an H100 were
within 6% (benchmarks/README.md)."""
import fnmatch
import inspect
import math

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .errors import fail
from .fsdp2_checks import sizes_problem
from .plan import PLAN_RANKS, aligned, figure_lines, plan_sizes, print_plan, scale_of

NOT_COUNTED = ("not counted: the CUDA context (about 0.5 GiB per GPU), allocator fragmentation, "
               "NCCL buffers, the DataLoader worker")
PLAN_HELP = (f"({NOT_COUNTED}.) Checked against real runs: the training state to the byte; peaks "
             "of a 1B model on an H100 within 6%%")  # --plan's help, after what it does


def plan_and_exit(args, model_class, tp_plan):
    """--plan: build model_class on the meta device from the flags named as its arguments, print
    each rank's memory for these flags (rank 0), write it to --metrics-json, exit 0. tp_plan: the
    tensor parallel plan that --tp-degree applies."""
    world_size, local_world_size, device_gib = plan_sizes(args)
    options = {"batch_size": args.batch_size, "grad_accum_steps": args.grad_accum_steps,
               "mixed_precision": args.mixed_precision, "cpu_offload": args.cpu_offload,
               "reshard_after_forward": not args.no_reshard_after_forward,
               "prefetch": args.prefetch_depth if args.explicit_prefetching else 1,
               "activation_checkpointing": args.activation_checkpointing, "tp": args.tp_degree,
               "tp_plan": tp_plan}
    problem = sizes_problem(args, world_size, local_world_size)
    if problem:
        fail(f"--plan: {problem}")
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = model_class(**{name: getattr(args, name)
                               for name in inspect.signature(model_class).parameters})
    plan = memory_plan(model, world_size, args.replicate_degree, **options)
    plan["fits"] = plan["peak_bytes"] <= device_gib * 2**30
    print_plan(plan_text(model, plan, world_size, args.replicate_degree, device_gib, options),
               plan, args.metrics_json, script="fsdp2_transformer.py")


def tensor_parallel_dims(model, tp_plan):
    """{parameter name: the dim that the tensor parallel plan splits it along}, for --plan."""
    dims = {}
    for pattern, style in tp_plan.items():
        for name, module in model.named_modules():
            if not fnmatch.fnmatch(name, pattern) or type(style) not in (ColwiseParallel,
                                                                       RowwiseParallel):
                continue
            colwise, embedding = type(style) is ColwiseParallel, isinstance(module, nn.Embedding)
            dims[f"{name}.weight"] = int(colwise != embedding)  # nn.Embedding's is (rows, dim)
            if colwise and getattr(module, "bias", None) is not None:
                dims[f"{name}.bias"] = 0  # rowwise: the bias is added once the sum is made
    return dims


def memory_plan(model, world_size, replicate, batch_size, grad_accum_steps, mixed_precision,
                cpu_offload, reshard_after_forward, prefetch, activation_checkpointing, tp=1,
                tp_plan=None):
    """Each rank's memory in bytes, from the model's shapes (on the meta device).

    Training state, exact: tensor parallel (tp > 1) splits parameters as tp_plan says, then
    FSDP2 shards each rank's part along dim 0 into world size / (replicate x tp) chunks (rank
    0's, the largest, is counted): fp32 parameters, gradients and AdamW's two moments, and a
    4-byte step per tensor. Activations: what autograd saves in one micro-batch's
    forward for backward, counted tensor by tensor for this model (the 17 x tokens x dim of a
    block: the inputs of 2 norms and 4 linears, q, k, v and attention's output, the MLP's two
    4 x dim tensors; norm statistics and attention's log-sum-exp in fp32; under tensor parallel
    all but the gathered inputs of q, k, v and the MLP divided by tp), with activation
    checkpointing only each block's input (and one block again while it is recomputed). The
    peak is at the start of backward: parameters and moments (gradients are freed at each step),
    gathered units, every activation, and the loss's three fp32 tokens x vocab buffers."""
    shard, dp = world_size // replicate // tp, world_size // tp
    compute = 2 if mixed_precision else 4  # bytes per element of the unsharded parameters
    dims = tensor_parallel_dims(model, tp_plan) if tp > 1 else {}
    sizes = {}  # name: this rank's part under tensor parallel, FSDP2's unsharded parameter
    for name, p in model.named_parameters():
        sizes[name] = [n // tp if i == dims.get(name) else n for i, n in enumerate(p.shape)]
    blocks = [[f"layers.{i}.{name}" for name, _ in block.named_parameters()]
              for i, block in enumerate(model.layers)]
    root = [name for name in sizes if not name.startswith("layers.")]
    params = list(model.parameters())
    local = sum(math.ceil(size[0] / shard) * math.prod(size[1:]) for size in sizes.values())
    plan = {"world_size": world_size, "parameters": sum(p.numel() for p in params),
            "parameter_bytes": 4 * local, "gradient_bytes": 4 * local,
            "optimizer_bytes": 8 * local + 4 * len(params)}
    plan["train_state_bytes"] = sum(plan[k] for k in ("parameter_bytes", "gradient_bytes",
                                                       "optimizer_bytes"))
    block_size, root_size = (sum(math.prod(sizes[name]) for name in names)
                             for names in (blocks[0], root))
    in_flight = len(blocks) if not reshard_after_forward else min(len(blocks), 1 + prefetch)
    plan["gathered_bytes"] = compute * (root_size + in_flight * block_size) + (
        4 * max(root_size, block_size) if cpu_offload else 0)  # offload: the fp32 copy in
    plan["reduce_scatter_bytes"] = (4 + (compute if mixed_precision else 0)) * block_size
    dim, heads = model.norm.weight.shape[0], model.layers[0].attention.n_heads
    vocab, seq_len = model.output.weight.shape[0], model.pos_embeddings.weight.shape[0]
    tokens = batch_size // dp // grad_accum_steps * seq_len  # in one micro-batch
    block = compute * tokens * dim * (2 + 15 / tp) + 4 * (4 + heads) * tokens / tp
    root_activations = compute * tokens * dim * (1 + 1 / tp) + 8 * tokens / tp + 8 * (
        2 * tokens + seq_len)
    saved = len(blocks) * (compute * tokens * dim / tp if activation_checkpointing else block)
    vocab = vocab // tp  # this rank's part of the logits (loss_parallel)
    plan["activation_bytes"] = int(saved + root_activations + 4 * tokens * vocab)  # log-softmax
    plan["recompute_bytes"] = int(block) if activation_checkpointing else 0
    plan["logits_bytes"] = 12 * tokens * vocab  # saved log-softmax, its gradient, the logits'
    # What saved_tensors_hooks count: the same, with the weights linears and norms save (the
    # gathered parameters, no memory of their own), the input of q, k and v saved by each (one
    # tensor), and the log-softmax saved twice (nll too).
    weights = (0 if activation_checkpointing else len(blocks) * (block_size - 6 * dim)) + (
        vocab * dim + 2 * dim)  # all but the embeddings and the linears' biases
    shared = 0 if activation_checkpointing else len(blocks) * 2 * compute * tokens * dim
    plan["saved_for_backward_bytes"] = plan["activation_bytes"] + 4 * tokens * vocab + (
        compute * weights + 4) + shared
    resident = 0 if cpu_offload else plan["parameter_bytes"] + plan["optimizer_bytes"]
    if grad_accum_steps > 1:  # gradients accumulate unsharded, in fp32, until the last micro-batch
        resident += 4 * sum(math.prod(size) for size in sizes.values())
    backward_start = resident + plan["gathered_bytes"] + plan["activation_bytes"] + (
        plan["logits_bytes"] - 4 * tokens * vocab)
    optimizer_step = 0 if cpu_offload else plan["train_state_bytes"]
    plan["peak_bytes"] = max(backward_start, optimizer_step)
    plan["host_bytes"] = plan["train_state_bytes"] if cpu_offload else 0
    return plan


def plan_text(model, plan, world_size, replicate, device_gib, options):
    """The plan as a table for people: this run's figures, then 1-64 ranks, then what would fit."""
    gib, (scale, unit), tp = 2**30, scale_of(plan), options["tp"]
    layout = (f"{replicate} replicas x {world_size // replicate // tp} shards, HSDP"
              if replicate > 1 else "every parameter sharded over all ranks" if tp == 1
              else f"{world_size // tp} shards")
    lines = [f"Plan: {plan['parameters']:,} parameters, world size {world_size} ({layout}"
             + f" x tensor parallel {tp}" * (tp > 1) + f"), per rank, in {unit}:"]
    rows = [("parameters (fp32 shards)", plan["parameter_bytes"]),
            ("gradients (fp32 shards)", plan["gradient_bytes"]),
            ("optimizer state (AdamW, fp32)", plan["optimizer_bytes"]),
            ("= training state" + (" (in host memory: --cpu-offload)" if options["cpu_offload"]
                                   else ""), plan["train_state_bytes"]),
            ("gathered FSDP units", plan["gathered_bytes"]),
            ("reduce-scatter buffers", plan["reduce_scatter_bytes"]),
            ("activations saved for backward", plan["activation_bytes"]),
            ("logits and loss buffers", plan["logits_bytes"]),
            ("predicted peak", plan["peak_bytes"])]
    lines += figure_lines(rows, plan, device_gib)
    table = []
    for ranks in PLAN_RANKS:
        if not splits(ranks, options):
            table.append([str(ranks), f"--batch-size {options['batch_size']} or --tp-degree "
                          f"{tp} does not divide"])
            continue
        row = memory_plan(model, ranks, 1, **options)
        table.append([str(ranks), *(f"{row[k] / scale:.2f}" for k in (
            "train_state_bytes", "activation_bytes", "peak_bytes")),
                      "yes" if row["peak_bytes"] <= device_gib * gib else "no"])
    lines += aligned(["ranks", "training state", "activations", "peak",
                      f"fits ({unit} per rank)"], table)
    if not plan["fits"]:
        lines.append("To fit: " + "; ".join(ways_to_fit(model, world_size, replicate, device_gib,
                                                         options)))
    lines.append(f"({NOT_COUNTED}.)")
    return "\n".join(lines)


def splits(ranks, options):
    """Whether the global batch (and each layer, under tensor parallel) splits over ranks."""
    dp = ranks // options["tp"]
    return ranks % options["tp"] == 0 and options["batch_size"] % (
        dp * options["grad_accum_steps"]) == 0


def ways_to_fit(model, world_size, replicate, device_gib, options):
    """The cheapest changes that bring the predicted peak under device_gib: one flag first, then
    two together; more ranks keep the global batch (each rank's share shrinks)."""
    def peak(ranks, replicas=1, **changes):
        if not splits(ranks, {**options, **changes}):
            return math.inf
        return memory_plan(model, ranks, replicas, **{**options, **changes})["peak_bytes"] / 2**30

    accum = {"grad_accum_steps": options["grad_accum_steps"] * 4}
    singles = [("--activation-checkpointing", {"activation_checkpointing": True}),
               (f"--grad-accum-steps {accum['grad_accum_steps']}", accum),
               ("--cpu-offload (slow)", {"cpu_offload": True})]
    ways = [f"--replicate-degree 1 ({peak(world_size):.1f} GiB)"] if (
        replicate > 1 and peak(world_size) <= device_gib) else []
    for name, change in singles:
        if not all(options[k] == v for k, v in change.items()):
            ways += [f"{name} ({peak(world_size, replicate, **change):.1f} GiB)"] if peak(
                world_size, replicate, **change) <= device_gib else []
    for ranks in [r for r in PLAN_RANKS if r > world_size]:
        for name, change in [("", {}), *singles[:1]]:
            if peak(ranks, **change) <= device_gib and not ways:
                ways.append(f"{ranks} ranks{' and ' + name if name else ''} "
                            f"({peak(ranks, **change):.1f} GiB)")
    if not ways:  # two flags together, at this world size
        for (a, change_a), (b, change_b) in [(singles[0], singles[1]), (singles[0], singles[2])]:
            if peak(world_size, **change_a, **change_b) <= device_gib:
                ways.append(f"{a} and {b} ({peak(world_size, **change_a, **change_b):.1f} GiB)")
    return ways or ["no one or two of --activation-checkpointing, gradient accumulation, "
                    "--cpu-offload or up to 64 ranks: a smaller model, batch or sequence"]
