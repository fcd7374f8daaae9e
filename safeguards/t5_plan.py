"""t5_fsdp_finetune.py --plan: each rank's memory predicted from --model-name's config.json alone
(the model built on the meta device: no weights read). tests/test_t5.py holds it against measured
runs (the training state of every strategy, exactly)."""
import math
import os

import torch
from transformers import AutoConfig, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

from .errors import fail, one_line
from .plan import PLAN_RANKS, aligned, figure_lines, plan_sizes, print_plan, scale_of
from .t5_checks import fsdp2_problem, lora_problem, lora_settings
from .workarounds import quiet_known_warnings

NOT_COUNTED = ("not counted: the CUDA context (about 0.5 GiB per GPU), allocator fragmentation, "
               "NCCL buffers, the DataLoader workers; activations are an estimate")
PLAN_HELP = (f"Reads only --model-name's config.json ({NOT_COUNTED}). The training state is exact "
             "(checked against runs of every strategy)")  # --plan's help, after what it does
# Elements autograd saves for backward in T5 (eager attention, dropout on), fitted by least
# squares to saved_tensors_hooks counts of 23 small T5 configurations in fp32 (within 0.2% of
# each): per encoder block, per decoder block, and once, over these products of sizes.
T5_SAVED = {"encoder": {"tokens_dim": 16.88, "tokens_ff": 1.38, "scores": 3.0,
                        "tokens_inner": 6.17},
            "decoder": {"tokens_dim": 9.76, "tokens_ff": 7.39, "scores": 3.0, "cross_scores": 3.0,
                        "tokens_inner": 5.75},
            "once": {"encoder_tokens_dim": 5.75, "decoder_tokens_dim": 3.87}}


def plan_and_exit(args, add_lora):
    """--plan: the T5 of --model-name's config on the meta device (with LoRA: add_lora's adapters),
    each rank's memory for these flags printed (rank 0) and written to --metrics-json; exit 0."""
    world_size, local_world_size, device_gib = plan_sizes(args)
    name = os.path.expanduser(args.model_name)
    if problem := fsdp2_problem(args) or lora_problem(args):
        fail(problem)
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        fail(f"--plan: {name} holds no config.json; pass a directory written by save_pretrained "
             "or a hub id such as t5-base")
    try:
        config = AutoConfig.from_pretrained(name)
    except Exception as e:
        fail(f"--plan: cannot read the config of --model-name {name} ({one_line(e)}); pass a "
             "save_pretrained directory, or a hub id on a machine with network")
    quiet_known_warnings()
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = T5ForConditionalGeneration(config)
        if lora := lora_settings(args):  # the same adapters, on the meta device
            model = add_lora(model, **lora)
    precision = args.mixed_precision if args.mixed_precision != "auto" else (
        "bf16" if torch.cuda.is_available() and not args.cpu else "fp32")
    options = {"strategy": args.sharding_strategy, "batch_size": args.batch_size,
               "input_length": args.input_length, "output_length": args.output_length,
               "compute_bytes": 2 if "bf16" in (precision, args.base_dtype) or (
                   precision == "fp16") else 4,
               "activation_checkpointing": args.activation_checkpointing,
               "fsdp_version": args.fsdp_version}
    plan = memory_plan(model, world_size, local_world_size, **options)
    plan["fits"] = plan["peak_bytes"] <= device_gib * 2**30
    print_plan(plan_text(model, plan, world_size, local_world_size, device_gib, options),
               plan, args.metrics_json, script="t5_fsdp_finetune.py")


def memory_plan(model, world_size, local_world_size, strategy, batch_size, input_length,
                output_length, compute_bytes, activation_checkpointing, fsdp_version=1):
    """Each rank's memory in bytes, from the model's shapes (on the meta device).

    Training state, exact: FSDP1 flattens each unit's parameters (one unit per T5Block, the rest
    in the root; LoRA's adapters stay whole on every rank) and pads the flat parameter to a
    multiple of the ranks it shards over (all of them, a node's under HYBRID_SHARD, none under
    NO_SHARD or with one process); FSDP2 shards each parameter along its first dimension (rank 0
    holds ceil(rows / ranks) rows). Each rank holds its shards of the parameters in their dtype (a
    LoRA base's may be bf16) and, of those that train, gradients and AdamW's two moments, and a
    4-byte step per flat parameter or adapter (FSDP1) or parameter (FSDP2). Activations:
    T5_SAVED's counts for the batch each rank trains (--batch-size is per rank); with
    activation checkpointing, only each block's input (and one block while it is recomputed)."""
    shard = {"NO_SHARD": 1, "HYBRID_SHARD": local_world_size}.get(strategy, world_size)
    blocks = [m for m in model.modules() if isinstance(m, T5Block)]
    frozen_base = any(not p.requires_grad for p in model.parameters())  # as wrap_model sees it
    adapters = [p for p in model.parameters() if p.requires_grad] if frozen_base else []
    units, seen = [[p] for p in adapters], {id(p) for p in adapters}  # FSDP1's: adapters whole,
    for module in (*blocks, model):  # each other parameter in the innermost unit that holds it
        units.append([p for p in module.parameters() if id(p) not in seen])
        seen.update(id(p) for p in units[-1])
    if fsdp_version == 2:  # each parameter once, tied or not, sharded by rows
        units = [[p] for p in model.parameters()]

    def local(unit):  # a unit's elements on rank 0
        if fsdp_version == 2:
            return math.ceil(unit[0].shape[0] / shard) * unit[0][0].numel()
        if unit[0].requires_grad and frozen_base:  # an adapter, under FSDP1
            return unit[0].numel()
        return math.ceil(sum(p.numel() for p in unit) / shard)

    units = [unit for unit in units if unit]
    trained = [unit for unit in units if unit[0].requires_grad]
    plan = {"world_size": world_size, "parameters": sum(p.numel() for p in model.parameters()),
            "trained_parameters": sum(p.numel() for unit in trained for p in unit),
            "parameter_bytes": sum(local(u) * u[0].element_size() for u in units),
            "gradient_bytes": sum(local(u) * u[0].element_size() for u in trained)}
    plan["optimizer_bytes"] = 2 * plan["gradient_bytes"] + 4 * len(trained)
    plan["train_state_bytes"] = sum(plan[k] for k in ("parameter_bytes", "gradient_bytes",
                                                       "optimizer_bytes"))
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    gathered = [plan["parameters"] - sum(block_sizes), *block_sizes]  # the root's, the blocks'
    if strategy == "FULL_SHARD" and shard > 1:  # the root and two blocks (one prefetched) at once
        gathered = [gathered[0], *sorted(block_sizes)[-2:]]
    plan["gathered_bytes"] = compute_bytes * sum(gathered)
    # --rouge's generation (ready_to_generate), besides the training state: gathered, the whole
    # state dict on every rank (cast to the compute dtype tensor by tensor); by block, as training
    # gathers, one unit after another.
    plan["generation_gathered_bytes"] = sum(p.numel() * p.element_size()
                                            for p in model.parameters())
    plan["generation_by_block_bytes"] = plan["gathered_bytes"]
    config = model.config
    dim, ff, heads, vocab = config.d_model, config.d_ff, config.num_heads, config.vocab_size
    inner = config.num_heads * config.d_kv
    encoder, decoder = batch_size * input_length, batch_size * output_length
    scores = {"scores": batch_size * heads * input_length ** 2}
    sizes = {"encoder": {"tokens_dim": encoder * dim, "tokens_ff": encoder * ff,
                         "tokens_inner": encoder * inner, **scores},
             "decoder": {"tokens_dim": decoder * dim, "tokens_ff": decoder * ff,
                         "scores": batch_size * heads * output_length ** 2,
                         "cross_scores": batch_size * heads * output_length * input_length,
                         "tokens_inner": decoder * inner}}
    per_block = {part: sum(T5_SAVED[part][k] * v for k, v in sizes[part].items())
                 for part in sizes}
    layers = {"encoder": config.num_layers, "decoder": config.num_decoder_layers}
    if activation_checkpointing:  # each block keeps its inputs (a decoder's: the encoder's too)
        saved = layers["encoder"] * (encoder * dim + scores["scores"]) + layers["decoder"] * (
            (decoder + encoder) * dim + sizes["decoder"]["scores"]
            + sizes["decoder"]["cross_scores"])
    else:
        saved = sum(layers[part] * per_block[part] for part in layers)
    once = T5_SAVED["once"]["encoder_tokens_dim"] * encoder * dim + (
        T5_SAVED["once"]["decoder_tokens_dim"] * decoder * dim)
    plan["activation_bytes"] = int(compute_bytes * (saved + once))
    plan["recompute_bytes"] = int(compute_bytes * max(per_block.values())) * (
        activation_checkpointing)
    plan["logits_bytes"] = 12 * decoder * vocab  # the fp32 log-softmax, its gradient, the logits'
    resident = plan["parameter_bytes"] + plan["optimizer_bytes"]
    plan["peak_bytes"] = max(resident + plan["gathered_bytes"] + plan["activation_bytes"]
                             + plan["recompute_bytes"] + plan["logits_bytes"],
                             plan["train_state_bytes"] + plan["gathered_bytes"])
    return plan


def plan_text(model, plan, world_size, local_world_size, device_gib, options):
    """The plan as a table for people: this run's figures, then 1-64 ranks, then what would fit."""
    gib, (scale, unit) = 2**30, scale_of(plan)
    lines = [f"Plan: {plan['parameters']:,} parameters, {options['strategy']} over world size "
             f"{world_size}, batch {options['batch_size']} per rank, per rank, in {unit}:"]
    if plan["trained_parameters"] < plan["parameters"]:
        lines.append(f"  LoRA: {plan['trained_parameters']:,} parameters train (the adapters), the "
                     "base is frozen: no gradients or optimizer state")
    rows = [("parameters (shards)", plan["parameter_bytes"]),
            ("gradients (fp32 shards)", plan["gradient_bytes"]),
            ("optimizer state (AdamW, fp32)", plan["optimizer_bytes"]),
            ("= training state", plan["train_state_bytes"]),
            ("gathered FSDP units", plan["gathered_bytes"]),
            ("activations saved for backward (estimate)", plan["activation_bytes"]),
            ("logits and loss buffers", plan["logits_bytes"]),
            ("predicted peak", plan["peak_bytes"]),
            ("generating (--rouge): --generate gathered, added", plan["generation_gathered_bytes"]),
            ("generating (--rouge): --generate by-block, added", plan["generation_by_block_bytes"])]
    lines += figure_lines(rows, plan, device_gib)
    by_ranks = {ranks: memory_plan(model, ranks, ranks, **options) for ranks in PLAN_RANKS}
    lines += aligned(["ranks", "training state", "peak", f"fits ({unit} per rank, one node)"], [
        [str(ranks), f"{row['train_state_bytes'] / scale:.2f}", f"{row['peak_bytes'] / scale:.2f}",
         "yes" if row["peak_bytes"] <= device_gib * gib else "no"]
        for ranks, row in by_ranks.items()])
    if not plan["fits"]:
        ways = []
        for name, change in (("--activation-checkpointing", {"activation_checkpointing": True}),
                             ("--mixed-precision bf16", {"compute_bytes": 2}),
                             ("--batch-size 1", {"batch_size": 1}),
                             ("--sharding-strategy FULL_SHARD", {"strategy": "FULL_SHARD"})):
            peak = memory_plan(model, world_size, local_world_size, **{**options, **change})[
                "peak_bytes"] / gib
            if peak <= device_gib and any(options[k] != v for k, v in change.items()):
                ways.append(f"{name} ({peak:.2f} GiB)")
        more = [r for r, row in by_ranks.items() if row["peak_bytes"] <= device_gib * gib]
        ways += [f"{more[0]} ranks"] if more and more[0] > world_size else []
        lines.append("To fit: " + ("; ".join(ways) or "combine these, or a smaller model"))
    lines.append(f"({NOT_COUNTED}.)")
    return "\n".join(lines)
