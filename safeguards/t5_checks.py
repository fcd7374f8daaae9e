"""t5_fsdp_finetune.py's checks, each a function that returns the line to stop with, or None:
flags that cannot work together, the local inputs (data, model directory, hub) said at once,
before the hub is tried (its retries take 30 s), what --resume and --save-dir hold; and the
choices this world and device make (strategy, precision, where the weights are read from)."""
import glob
import importlib
import json
import os

import huggingface_hub
import torch
import torch.nn as nn
from transformers import AutoConfig, T5ForConditionalGeneration

from summarization_dataset import DOWNLOAD_HELP, ROUGE_INSTALL, WikiHowError, check_csv

from .errors import in_one_line, one_line, rank0_print
from .flags import compile_problem, fsdp1_strategy
from .t5_saves import resume_problem, t5_folder

# What the one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or --mixed-precision bf16 or fp32 instead of fp16"
MEMORY_ADVICE = ("use a smaller --batch-size, --test-batch-size, --input-length or "
                 "--output-length, or --activation-checkpointing")


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


