"""Where a training step of t5_fsdp_finetune.py spends its time, by kind (torch.profiler).

Run under torchrun; it builds the script's model with the script's own units (FSDP1's wrap_model
or FSDP2's shard_model, LoRA's add_lora), trains --warmup steps, profiles --steps more on every
rank, and rank 0 prints one JSON line: the median step time and, per kind of work, the profiled
self time per step (CPU time of the ops themselves, not of what they call), how many of them ran
per step and, on a GPU, their kernels' time (gpu_ms). "FSDP's own Python" is the self time of
FSDP's labelled regions (its hooks, its lazy initialization): what runs there that is not an op.
"outside the ops" is the step's wall time less every op's self time (Python of the model, PEFT
and autograd's engine).

    torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py MODEL_DIR DATA_DIR \\
        --fsdp-version 1 --lora-rank 8 [--script OLD/t5_fsdp_finetune.py]
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

# The kinds, by the ops' names (the first that matches); what matches none is "other ops".
KINDS = {
    "communication": ("c10d::", "gloo:", "nccl:", "record_param_comms", "all_gather",
                      "reduce_scatter", "all_reduce", "broadcast"),
    "FSDP's own Python": ("FullyShardedDataParallel", "FSDP::"),
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "copies, casts, views": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::cat",
                             "aten::split", "aten::view", "aten::as_strided", "aten::slice",
                             "aten::narrow", "aten::empty", "aten::zero_", "aten::fill_",
                             "aten::detach", "aten::t", "aten::transpose", "aten::reshape",
                             "aten::_unsafe_view", "aten::clone", "aten::contiguous",
                             "aten::flatten", "aten::chunk", "aten::set_", "aten::resize_"),
    "optimizer": ("Optimizer.", "aten::_foreach", "aten::_fused_adam", "aten::addcdiv",
                  "aten::addcmul", "aten::lerp", "aten::sqrt"),
    "dropout": ("aten::dropout", "aten::native_dropout", "aten::bernoulli"),
}


def kind_of(name):
    return next((kind for kind, prefixes in KINDS.items()
                 if any(name.startswith(p) or p in name for p in prefixes)), "other ops")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("data_dir")
    parser.add_argument("--fsdp-version", type=int, choices=[1, 2], default=1)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="compute dtype (bf16: the script's bf16 policies; a GPU's)")
    parser.add_argument("--lengths", type=int, nargs=2, default=[64, 24], metavar=("IN", "OUT"),
                        help="--input-length and --output-length")
    parser.add_argument("--compile", action="store_true", help="each T5Block compiled before "
                        "sharding, as the script's --compile does (FSDP2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--script", default=str(Path(__file__).resolve().parent.parent
                                                / "t5_fsdp_finetune.py"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.script).resolve().parent))  # its summarization_dataset.py
    spec = importlib.util.spec_from_file_location("t5_fsdp_finetune", args.script)
    t5 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t5)

    cuda = torch.cuda.is_available()  # on a GPU: NCCL, and each kind's GPU time too
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else (
        torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, tokenizer = t5.load_model_and_tokenizer(args.model_dir)
    if args.lora_rank:
        model = t5.add_lora(model, args.lora_rank, alpha=16, dropout=0.0, targets=["q", "v"],
                            base_dtype=torch.float32)
    train_set, _ = t5.load_data(tokenizer, args.data_dir, *args.lengths, num_train=512,
                                num_val=None)
    batches = iter(t5.rank_loader(train_set, args.batch_size, device))
    mesh = t5.device_mesh(device, hybrid=False)
    for block in (*model.encoder.block, *model.decoder.block) if args.compile else []:
        block.compile(dynamic=False)
    if args.fsdp_version == 1:
        model = t5.wrap_model(model, mesh, device, sharding_strategy="FULL_SHARD",
                              mixed_precision=t5.POLICIES[args.precision],
                              backward_prefetch="BACKWARD_PRE",
                              limit_all_gathers=True, activation_checkpointing=False)
    else:
        model = t5.shard_model(model, mesh, device, sharding_strategy="FULL_SHARD",
                               mp_policy=t5.POLICIES_FSDP2[args.precision],
                               activation_checkpointing=False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=cuda)
    if args.lora_rank and args.fsdp_version == 1 and hasattr(t5, "average_gradients"):
        optimizer.register_step_pre_hook(lambda *_: t5.average_gradients(trained))

    def step():
        batch = {key: value.to(device) for key, value in next(batches).items()}
        optimizer.zero_grad(set_to_none=True)
        t5.per_example_loss(model, batch).mean().backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    seconds = []
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        for _ in range(args.steps):
            dist.barrier()
            started = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
    kinds = {}
    for event in profiler.key_averages():
        kind = kinds.setdefault(kind_of(event.key), {"ms": 0.0, "calls": 0, "gpu_ms": 0.0})
        kind["ms"] += event.self_cpu_time_total / 1000 / args.steps
        kind["calls"] += event.count / args.steps
        kind["gpu_ms"] += getattr(event, "self_device_time_total", 0) / 1000 / args.steps
    step_ms = 1000 * statistics.mean(seconds)
    kinds["outside the ops"] = {"ms": step_ms - sum(k["ms"] for k in kinds.values()), "calls": 0,
                                "gpu_ms": 0.0}
    if dist.get_rank() == 0:
        print(json.dumps({"fsdp_version": args.fsdp_version, "lora_rank": args.lora_rank,
                          "compile": args.compile, "step_ms": 1000 * statistics.median(seconds),
                          "ops_per_step": round(sum(k["calls"] for k in kinds.values()), 1),
                          "kinds": {k: {"ms": round(v["ms"], 2), "calls": round(v["calls"], 1),
                                        **({"gpu_ms": round(v["gpu_ms"], 2)} if cuda else {})}
                                    for k, v in sorted(kinds.items(),
                                                       key=lambda kv: -kv[1]["ms"])}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
