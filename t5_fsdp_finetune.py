"""FSDP fine-tuning of Hugging Face T5 for WikiHow summarization, on GPUs or on CPU.

After the PyTorch tutorial "Advanced Model Training with Fully Sharded Data Parallel": FSDP1 on a
pretrained model, one unit per T5Block, device_id initialization, sharding strategies, backward
prefetch, mixed precision, activation checkpointing, the rank-0 streaming full-state-dict save
and resumable sharded (DCP) checkpoints; --fsdp-version 2 shards the same units with FSDP2
(fully_shard, which fsdp2_transformer.py teaches). --lora-rank trains LoRA adapters (PEFT) on the
frozen model instead of every weight. --max-tokens cuts each step into micro-batches of at most N
tokens, the ranks kept in step (micro_batches). The FSDP parts: wrap_model(), shard_model().

    python t5_fsdp_finetune.py                           # one process per GPU, or 2 CPU processes
    torchrun --nproc_per_node 4 t5_fsdp_finetune.py --sharding-strategy SHARD_GRAD_OP \\
        --activation-checkpointing --checkpoint-type sharded --save-dir runs/t5 --fsdp-version 2
    torchrun --nproc_per_node 4 --max-restarts 3 t5_fsdp_finetune.py --checkpoint-type sharded \\
        --save-dir runs/t5 --resume auto                 # restarts resume after the last epoch
    torchrun --nproc_per_node 4 t5_fsdp_finetune.py --fsdp-version 2 --lora-rank 16 \\
        --base-dtype bf16 --lr 3e-4                      # LoRA: exports adapters and a merged model

Data: wikihowAll.csv in --data-dir (README.md, "Data"). CUDA + NCCL with a GPU, else CPU + gloo.
"""
import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoConfig, T5ForConditionalGeneration, T5Tokenizer
from transformers.models.t5.modeling_t5 import T5Block
from transformers.utils import logging as hf_logging

from safeguards import checkpoints, describe, errors, t5_saves, workarounds
from safeguards import t5_checks as checks
from safeguards.epoch_log import EpochLog
from safeguards.flags import RankZeroArgumentParser, add_plan_flags, add_run_flags, positive
from safeguards.launch import launch, local_rank_zero_first
from safeguards.t5_checks import DIVERGED, MEMORY_ADVICE
from safeguards.t5_plan import PLAN_HELP, plan_and_exit
from summarization_dataset import ROUGE_INSTALL, ROUGE_KEYS, rouge_scores, wikihow


def rank0_print(*args, **kwargs):
    """print on rank 0 only: the one helper of the lesson's pieces."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


# ----------------------------------------------------------------------------------- model, data
def load_model_and_tokenizer(name, on_meta=False):
    """The pretrained model in fp32 (FSDP's master weights) and its tokenizer. on_meta: only the
    model's structure, on the meta device, without loading or allocating any weight."""
    tokenizer = T5Tokenizer.from_pretrained(name)
    if on_meta:
        with torch.device("meta"):
            return T5ForConditionalGeneration(AutoConfig.from_pretrained(name)), tokenizer
    return T5ForConditionalGeneration.from_pretrained(name, dtype=torch.float32), tokenizer


def add_lora(model, rank, alpha, dropout, targets, base_dtype):
    """LoRA with PEFT, before sharding: the model's weights frozen, in base_dtype (or its name:
    "bf16" halves their memory), and beside each Linear named in targets two trainable matrices
    (the adapters, fp32) of rank `rank`, whose product scaled by alpha / rank adds to its output."""
    model.to(BASE_DTYPES.get(base_dtype, base_dtype))
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                            target_modules=targets, task_type="SEQ_2_SEQ_LM"))


def load_data(tokenizer, data_dir, input_length, output_length, num_train, num_val):
    """The train and validation sets (num_val None: none); a WikiHowError says what is wrong."""
    options = {"input_length": input_length, "output_length": output_length, "data_dir": data_dir}
    train_set = wikihow(tokenizer, "train", num_train, **options)
    return train_set, wikihow(tokenizer, "validation", num_val, **options) if num_val else None


def rank_loader(dataset, batch_size, device, shuffle=False, seed=0):
    """Batches of this rank's share of dataset; on a GPU, made by workers, in pinned memory."""
    options = {"num_workers": 2, "pin_memory": True} if device.type == "cuda" else {}
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **options)


# ------------------------------------------------------------------------------------------ FSDP
# The tutorial's four policies: compute (param), gradient-communication (reduce) and buffer dtypes
# of FSDP's master weights. A dtype left out is not cast (the tutorial's fp32 policy names fp32:
# it would compute a bf16 LoRA base in fp32). cast_forward_inputs: in every unit, as FSDP2 does.
POLICIES = {  # MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)
    "fp32": MixedPrecision(),
    "bf16": MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16,
                           cast_forward_inputs=True),
    "fp16": MixedPrecision(torch.float16, torch.float16, torch.float16, cast_forward_inputs=True),
    "grad-bf16": MixedPrecision(reduce_dtype=torch.bfloat16),
}
POLICIES_FSDP2 = {  # FSDP2's: computed in param_dtype, gradients reduced in reduce_dtype
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "grad-bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
}
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --base-dtype: LoRA's frozen base
# Non-reentrant activation checkpointing takes T5Block's keyword arguments and recomputes with the
# saved RNG state (same dropout, same losses). Not the tutorial's offload_to_cpu=False: newer torch
# hands it on to T5Block.forward (the TypeError of pytorch/examples#1210).
NON_REENTRANT = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def device_mesh(device, hybrid):
    """The ranks FSDP shards over; hybrid (HSDP): replicated across nodes, sharded within each."""
    world_size, local_world_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    if hybrid:
        return init_device_mesh(device.type, (world_size // local_world_size, local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def materialize_on(module, device):
    """FSDP1's param_init_fn for a model on the meta device: the module's own tensors get memory
    on device for rank 0's values, swapped in place (torch.__future__'s switch, here only): a
    parameter two modules share (T5's embedding and lm_head) stays one, where by default
    to_empty makes a tensor per module."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    module.to_empty(device=device, recurse=False)
    torch.__future__.set_swap_module_params_on_conversion(swap)


def wrap_model(model, mesh, device, sharding_strategy, mixed_precision, backward_prefetch,
               limit_all_gathers, activation_checkpointing, sync_module_states=False):
    """FSDP1 with one unit per T5Block: each rank keeps its shard of the parameters, gradients
    and optimizer state; a unit's parameters are gathered only while it computes.
    sync_module_states: only rank 0's model has weights, the others are on the meta device."""
    # LoRA (add_lora): FSDP1 flattens a unit into one tensor, trained or frozen as a whole, so an
    # adapter in a unit of its own would cost two all-gathers, a reduce-scatter and their hooks per
    # step, each (LoRA at 0.45x full fine-tuning's speed); use_orig_params=True would compute the
    # frozen base's gradients. So FSDP1 leaves the adapters whole on every rank (they are small)
    # and average_gradients all-reduces their gradients, in one bucket, before each step.
    frozen_base = any(not p.requires_grad for p in model.parameters())
    adapters = [p for p in model.parameters() if p.requires_grad] if frozen_base else []
    model = FSDP(
        model,  # on CPU; device_id moves it to the device one FSDP unit at a time
        # A unit per T5Block; the shared embedding (encoder, decoder, lm_head) stays in the root.
        auto_wrap_policy=CustomPolicy(lambda module: isinstance(module, T5Block)),
        ignored_states=adapters or None,
        sharding_strategy=ShardingStrategy[sharding_strategy],
        # HYBRID_SHARD's mesh is 2-D. With a mesh, FSDP1's sharded state dicts hold DTensors.
        device_mesh=mesh,
        mixed_precision=mixed_precision,
        backward_prefetch=(None if backward_prefetch == "NONE"
                           else BackwardPrefetch[backward_prefetch]),
        limit_all_gathers=limit_all_gathers,
        device_id=device,  # also on CPU: without it FSDP1 looks for an accelerator and refuses
        # --cpu-ram-efficient-loading: only rank 0 has the weights; the others, on the meta device,
        # get memory (param_init_fn) and then rank 0's values (sync_module_states).
        sync_module_states=sync_module_states,
        param_init_fn=functools.partial(materialize_on, device=device),
    )
    for adapter in adapters:  # (FSDP1 moves and syncs only what it shards)
        adapter.data = adapter.data.to(device)
        if sync_module_states:
            dist.broadcast(adapter.data, src=0)
    if activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, T5Block),
                                       checkpoint_wrapper_fn=NON_REENTRANT)
    return model


def average_gradients(parameters):
    """The mean over the ranks of the gradients of parameters every rank holds whole (FSDP1's LoRA
    adapters, see wrap_model), as FSDP averages those it shards: one all-reduce of them all."""
    grads = [p.grad for p in parameters if p.grad is not None]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, mean in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(mean.view_as(grad))


def shard_model(model, mesh, device, sharding_strategy, mp_policy, activation_checkpointing,
                broadcast_from_rank0=False, weights=None):
    """FSDP2 with wrap_model's units: each T5Block (with its LoRA adapters: FSDP2 makes gradients
    per parameter, and since torch 2.10 only those that train must share a dtype), then the root,
    whose group holds the embedding that encoder, decoder and a tied lm_head share (fully_shard(
    model.shared) alone is refused). The parameters become DTensor shards in place, same names.
    broadcast_from_rank0: only rank 0's model has weights, the others are on the meta device.
    weights: a folder of safetensors from which each rank's model, on the meta device, reads its
    shards (load_pretrained_shards): no rank holds the whole model."""
    full_state = model.state_dict() if broadcast_from_rank0 and dist.get_rank() == 0 else {}
    if activation_checkpointing:  # as in wrap_model, but before sharding
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, T5Block),
                                       checkpoint_wrapper_fn=NON_REENTRANT)
    for module in (*model.encoder.block, *model.decoder.block, model):  # PEFT passes .encoder on
        fully_shard(module, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=sharding_strategy != "SHARD_GRAD_OP")  # ZeRO-2: False
    if broadcast_from_rank0 or weights:
        model.to_empty(device=device)  # this rank's shards get memory; tied ones stay one tensor
    if weights:
        load_pretrained_shards(model, weights)
    elif broadcast_from_rank0:
        set_model_state_dict(model, full_state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))  # each rank gets its shards
    return model


def hf_state(model, merge=False):
    """This rank's shards (DTensors) of the sharded model by their names in its HF files (without
    PEFT's prefix and base_layer): a tied tensor once (T5's embedding, also encoder's, decoder's
    and a tied lm_head's), no LoRA adapter. merge: each adapted weight's rows plus the product of
    its adapters (B's rows are the weight's: each rank adds its own), as merge_and_unload does."""
    sharded, state, storages = get_model_state_dict(model), {}, set()
    for name, tensor in sharded.items():
        storage = tensor.to_local().untyped_storage().data_ptr()
        if "lora_" in name or storage in storages:
            continue
        storages.add(storage)
        if merge and ".base_layer." in name:  # LoRA
            a, b = (sharded[name.replace("base_layer", f"lora_{m}.default")] for m in "AB")
            lora = model.peft_config["default"]
            rows = tensor.to_local() + lora.lora_alpha / lora.r * b.to_local() @ a.full_tensor()
            tensor = DTensor.from_local(rows.to(tensor.dtype), device_mesh=tensor.device_mesh,
                                        placements=tensor.placements, shape=tensor.shape,
                                        stride=tensor.stride())
        state[name.removeprefix("base_model.model.").replace(".base_layer", "")] = tensor
    return state


def load_pretrained_shards(model, path):
    """Each rank reads its part of the pretrained weights from the safetensors files in path into
    its shards (the model sharded, materialized): DCP's HF reader reads the rows a rank holds, no
    rank the whole model. LoRA's adapters, not in the files, get PEFT's initialization (A Kaiming-
    uniform, B zero; other draws than PEFT's), drawn whole alike on every rank, then sharded."""
    dcp.load(hf_state(model), storage_reader=HuggingFaceStorageReader(path))
    for name, param in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            full = torch.zeros(param.shape, dtype=param.dtype)
            if "lora_A" in name:
                nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            with torch.no_grad():  # into this rank's shard
                param.to_local().copy_(distribute_tensor(full, param.device_mesh,
                                                         param.placements).to_local())


# ------------------------------------------------------------------------------------------ step
def per_example_loss(model, batch):
    """Cross-entropy of each example, averaged over its real target tokens (labels -100: padding).
    HF's own loss is a token mean over the whole batch; a mean per example makes the epoch loss
    independent of how examples are batched and spread over ranks."""
    # use_cache=False: the key/value cache is for generation; in training it costs memory, and the
    # recompute of activation checkpointing fails on it ("A different number of tensors was saved").
    logits = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                   labels=batch["target_ids"], use_cache=False).logits
    losses = F.cross_entropy(logits.float().transpose(1, 2), batch["target_ids"],
                             ignore_index=-100, reduction="none")
    return losses.sum(dim=1) / (batch["target_ids"] != -100).sum(dim=1)


def micro_batches(batch, max_tokens):
    """This rank's share of a step (batch) in micro-batches of at most max_tokens tokens (None:
    [batch]), sorted by length, cut greedily, each cut to its longest source and target (its
    tokens: examples x their sum) rather than padded to --input-length and --output-length; an
    example longer than max_tokens goes alone. A rank that ran fewer would leave the others
    waiting in FSDP's all-gathers: the ranks agree on the count (on a GPU a host sync per step: it
    decides how many passes run), and one with fewer adds fillers (zero weight) to run each unit."""
    if max_tokens is None:
        return [batch]
    lengths = torch.stack([batch["source_mask"].sum(1), batch["target_mask"].sum(1)], 1).cpu()
    groups = []  # each the indices of its examples, the shortest first
    for i in lengths.sum(dim=1).argsort(stable=True).tolist():
        group = [*groups[-1], i] if groups else [i]
        if len(group) > 1 and len(group) * lengths[group].amax(dim=0).sum() <= max_tokens:
            groups[-1] = group
        else:
            groups.append([i])
    batches = []
    for group in groups:  # each without the padding columns that none of its examples uses
        part = {"weight": batch["weight"][group]}
        longest = dict(zip(("source", "target"), lengths[group].amax(dim=0).tolist()))
        for key in ("source_ids", "source_mask", "target_ids", "target_mask"):
            part[key] = batch[key][group, :longest[key.split("_")[0]]]  # a copy, contiguous
        batches.append(part)
    count = torch.tensor(len(batches), device=batch["weight"].device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    filler = {**batches[0], "weight": torch.zeros_like(batches[0]["weight"])}  # adds nothing
    batches += [filler] * (count.item() - len(batches))
    return batches


def train(model, loader, optimizer, scaler, epoch, device, max_tokens=None, bar=tqdm):
    """One epoch; rank 0 shows its progress with bar (tqdm's interface). max_tokens: each step's
    gradients added up over micro-batches of at most that many tokens (micro_batches)."""
    model.train()
    loader.sampler.set_epoch(epoch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed example losses, examples
    for batch in bar(loader, desc=f"r0 Training Epoch {epoch}", colour="blue", leave=False,
                     disable=dist.get_rank() != 0):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch["weight"] = torch.ones(len(batch["source_ids"]), device=device)  # fillers': 0
        examples = batch["weight"].sum()
        dist.all_reduce(examples)  # of the step's global batch, over which the loss averages
        optimizer.zero_grad(set_to_none=True)
        # The gradients add up over the micro-batches, each one's reduce-scattered at once (FSDP's
        # no_sync would keep them unsharded until the last: less communication, more memory).
        for part in micro_batches(batch, max_tokens):
            losses = per_example_loss(model, part) * part["weight"]
            # Times the ranks: FSDP averages their gradients (sums them divided by the ranks).
            loss = losses.sum() * dist.get_world_size() / examples
            (scaler.scale(loss) if scaler else loss).backward()  # fp16: scaled, no underflow
            totals += torch.stack([losses.detach().sum(), part["weight"].sum()])
        if scaler:  # fp16: one step, unscaled, skipped if a gradient overflowed
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    dist.all_reduce(totals)
    rank0_print(f"Train Epoch: \t{epoch}, Loss: \t{totals[0] / totals[1]:.4f}")
    return (totals[0] / totals[1]).item()


def validation(model, loader, device, max_tokens=None, bar=tqdm):
    model.eval()
    sampler, seen = loader.sampler, 0
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed example losses, examples
    with torch.no_grad():
        for batch in bar(loader, desc="Validation Epoch", colour="green", leave=False,
                         disable=dist.get_rank() != 0):
            batch = {k: v.to(device) for k, v in batch.items()}
            # DistributedSampler repeats examples to give every rank as many batches (FSDP needs
            # all ranks in every forward): count each example once, by its index rank + k * ranks.
            index = sampler.rank + sampler.num_replicas * torch.arange(
                seen, seen + len(batch["source_ids"]))
            batch["weight"] = (index < len(sampler.dataset)).to(device, torch.float32)
            seen += len(index)
            for part in micro_batches(batch, max_tokens):
                losses = per_example_loss(model, part) * part["weight"]
                totals += torch.stack([losses.sum(), part["weight"].sum()])
    dist.all_reduce(totals)
    rank0_print(f"Validation Loss: {totals[0] / totals[1]:.4f}")
    return (totals[0] / totals[1]).item()


# ------------------------------------------------------------------------------------ generation
@contextlib.contextmanager
def ready_to_generate(model, gather_once=True, dtype=None):
    """The sharded model ready for generate(), which runs the T5 inside FSDP's root, whose hooks,
    which gather the root's parameters (the embedding, final norms), thus never run. gather_once: a
    plain copy of the whole model on each rank, in dtype (None: as trained), which generates with no
    collective per token; else the root's parameters gathered here, each block's in its forward."""
    if gather_once:  # (FSDP1's summon_full_params cannot serve: a unit's forward frees them)
        options = StateDictOptions(full_state_dict=True)  # every rank gets the whole state dict
        yield plain_model(model, get_model_state_dict(model, options=options)).to(dtype).eval()
    elif isinstance(model, FSDP):
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            yield model
    else:  # FSDP2: the root's group (not recursive) gathered as each generate() starts encoding
        hook = model.get_encoder().register_forward_pre_hook(lambda *_: model.unshard())
        yield model
        hook.remove()
        model.reshard()


def generate_summaries(model, loader, tokenizer, device, gather_once=True, dtype=None, **options):
    """The summaries of loader's articles, in order, each generated by one rank with options
    (num_beams, max_new_tokens...), gathered once; keyed by article until then, so that those
    DistributedSampler repeats (to even out the ranks' batches) count once."""
    model.eval()
    indices, summaries = list(loader.sampler), {}
    # Eager: a compiled block (--compile) would compile again for each length the cache grows to.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), ready_to_generate(
            model, gather_once, dtype) as generator:
        for batch in loader:
            # Block by block, a rank whose summaries end first runs forwards until every rank's
            # have (synced_gpus): each forward's all-gathers pair up with the other ranks'.
            ids = generator.generate(input_ids=batch["source_ids"].to(device),
                                     attention_mask=batch["source_mask"].to(device),
                                     synced_gpus=not gather_once, **options)
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            summaries.update(zip(indices, texts))
            indices = indices[len(texts):]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, summaries)
    everyone = {index: text for rank in ranks for index, text in rank.items()}
    return [everyone[index] for index in range(len(loader.dataset))]


# ------------------------------------------------------------------------------------ checkpoint
TRAINER_STATE = "trainer_state.json"  # written last into a sharded checkpoint: marks it complete


def trained_state(model, optimizer):
    """This rank's shards of a resumable checkpoint: the optimizer's state and the tensors it trains
    (LoRA: not the frozen base, which ignore_frozen_params would keep under its tied names)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": {k: v for k, v in model_state.items() if k in optimizer_state["state"]},
            "optimizer": optimizer_state}


def replace_directory(path, *writers):
    """Write the directory path with writers (each called with a temporary path), then rename."""
    shutil.rmtree(f"{path}.tmp", ignore_errors=True)  # the leftover of a crash
    for write in writers:
        write(f"{path}.tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(f"{path}.tmp", path)


def export_model(model, tokenizer, path, cpu_offload=True):
    """Rank 0 writes path.pt (the full state dict) and the HF directory path-hf, each under a
    temporary name renamed once complete; all ranks call it. get_model_state_dict(full_state_dict,
    cpu_offload) is the tutorial's streaming FULL_STATE_DICT save (offload_to_cpu, rank0_only)
    without the deprecated FSDP.state_dict_type context: the parameters are gathered one FSDP
    unit at a time and only rank 0 keeps them, on CPU. LoRA: path-hf is the merged model (each
    adapter's product added into its weight), path-adapter what PeftModel.from_pretrained opens."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return
    torch.save(state, f"{path}.pt.tmp")
    os.replace(f"{path}.pt.tmp", f"{path}.pt")
    lora, plain = getattr(model, "peft_config", None), plain_model(model, state)
    if lora:
        replace_directory(f"{path}-adapter", plain.save_pretrained)  # the adapters alone
        plain = plain.merge_and_unload()
    plain.generation_config = model.generation_config
    replace_directory(f"{path}-hf", plain.save_pretrained, tokenizer.save_pretrained)
    rank0_print(f"Saved {path}.pt, {path}-hf" + (f" and {path}-adapter" if lora else ""))


def plain_model(model, state):
    """model's T5 (LoRA: with its adapters) without FSDP, holding state (the full state dict)."""
    lora = getattr(model, "peft_config", None)  # PEFT's configuration (FSDP1 passes it on)
    with torch.device("meta"):  # no second random initialization: weights from state
        plain = T5ForConditionalGeneration(model.config)
        if lora:
            plain = get_peft_model(plain, lora["default"])
    plain.load_state_dict(state, assign=True)
    base = plain.get_base_model() if lora else plain
    # Tied as trained: flan-t5's lm_head is its own, though its T5Config says tied.
    base.config.tie_word_embeddings = torch.equal(base.lm_head.weight, base.shared.weight)
    base.tie_weights()
    return plain


def export_shards(model, tokenizer, path):
    """FSDP2's export, no rank holding the whole model: every rank writes its shards in HF's
    safetensors format (DCP's HF writer), which rank 0 consolidates a tensor at a time into the
    files from_pretrained opens, in path-hf (with config, generation config, tokenizer) renamed
    once complete. LoRA: the merged model, and the adapters, gathered, in path-adapter."""
    state, lora = hf_state(model, merge=True), getattr(model, "peft_config", None)
    # Files of a quarter of the model, at most 5 GB (HF's max_shard_size), with an index: the
    # writer copies a rank's part of one file at a time, twice (FSDP2's padded shards cloned, then
    # serialized), so each rank copies at most model / 2N (one file: 2 model / N).
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    max_file_bytes = min(5 * 2**30, total / 4)
    file_of, index, size = {}, 1, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_file_bytes:
            index, size = index + 1, 0
        file_of[name], size = index, size + nbytes
    # PEFT's names in its files; not model.save_pretrained(state_dict=), which looks the adapters
    # up by their modules' names, activation checkpointing's wrapper included, and finds none.
    adapters = {name.replace(".default.weight", ".weight"): tensor.full_tensor()
                for name, tensor in get_model_state_dict(model).items() if "lora_" in name}
    files = f"{path}-hf.files.tmp"  # DCP's consolidated files; the ranks' in files/sharded
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        files, save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=file_of))
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(files, "sharded"))
        model.config.dtype = state["shared.weight"].dtype  # the files' (a bf16 LoRA base: bf16)
        replace_directory(f"{path}-hf", lambda folder: os.replace(files, folder),
                          model.config.save_pretrained, model.generation_config.save_pretrained,
                          tokenizer.save_pretrained)
        if lora:
            replace_directory(f"{path}-adapter", lora["default"].save_pretrained, lambda folder:
                              save_file(adapters, f"{folder}/adapter_model.safetensors"))
    rank0_print(f"Saved {path}-hf" + (f" and {path}-adapter" if lora else ""))


def save_sharded_checkpoint(model, optimizer, trainer_state, path):
    """Every rank writes its shards of what trains and of the optimizer state (trained_state) into
    path.tmp (dcp.save, a collective); rank 0 adds the trainer state (epoch, scheduler, losses),
    which marks it complete, last, and renames it to path."""
    if dist.get_rank() == 0:  # the leftover of a crash, among whose files DCP would write
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)
    dist.barrier()
    dcp.save(trained_state(model, optimizer), checkpoint_id=f"{path}.tmp")
    if dist.get_rank() == 0:
        with open(os.path.join(f"{path}.tmp", TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(f"{path}.tmp", path)
    dist.barrier()
    rank0_print(f"Saved sharded checkpoint {path}")


def load_sharded_checkpoint(path, model, optimizer, scheduler, scaler):
    """Load a sharded checkpoint into model, optimizer, scheduler and grad scaler, at any world
    size (each rank reads what its shards hold of the saved ones); return its trainer state."""
    with open(os.path.join(path, TRAINER_STATE)) as f:
        state = json.load(f)
    loaded = trained_state(model, optimizer)  # to fill
    dcp.load(loaded, checkpoint_id=path)  # DCP raises on every rank if any rank fails
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optimizer"], options=StateDictOptions(strict=False))
    scheduler.load_state_dict(state["scheduler"])
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rank0_print(f"Resumed from {path} (epoch {state['epoch']} done)")
    return state


class Checkpointer:
    """The trainer state of the epochs (losses, the best model so far: the lowest validation loss,
    or the last epoch's, or --best-metric's), the best model's export into folder (None: no
    saves), and resumable sharded checkpoints. full_state_dict: exports gathered on rank 0
    (cpu_offload: into its host memory), else written from every rank's shards; record: what the
    trainer state also holds (the LoRA settings)."""

    def __init__(self, folder, model, optimizer, scheduler, scaler, tokenizer, *,
                 full_state_dict=True, cpu_offload=True, best_by="val_loss", record=None):
        self.folder, self.tokenizer = folder and os.path.abspath(folder), tokenizer
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.full_state_dict = scaler, full_state_dict
        self.cpu_offload = cpu_offload
        self.best_by = best_by  # val_loss, or a ROUGE score: rouge1, rouge2, rougeL, rougeLsum
        now = [datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")]
        dist.broadcast_object_list(now)  # rank 0's: the ranks' clocks (to the second) may differ
        self.run_name = f"T5-model-{now[0]}"  # every rank writes its shards of an export there
        self.state = {"epoch": 0, "best_val_loss": None, "best_checkpoint": None,
                      "train_losses": [], "val_losses": [], **(record or {})}

    def load(self, path):
        """Resume from the sharded checkpoint at path: the trainer state and what trains."""
        self.state = load_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                             self.scaler)

    def epoch_done(self, epoch, train_loss, val_loss, last, rouge=None):
        """Record the epoch; return where to export the model if it is the best so far (and there
        is a folder), else None."""
        state, best = self.state, self.state["best_val_loss"]
        state["train_losses"].append(train_loss)
        state["val_losses"].append(val_loss)
        improved = last if val_loss is None else best is None or val_loss < best
        if self.best_by in (rouge or {}):  # --best-metric: the highest ROUGE score, not the loss
            previous = state.get("best_rouge")  # None: no epoch scored yet
            improved = previous is None or rouge[self.best_by] > previous
        if improved and val_loss is not None:
            state.update(best_val_loss=val_loss, best_rouge=(rouge or {}).get(self.best_by))
            rank0_print(f"-->>>> New Val Loss Record: {val_loss:.4f}" if self.best_by == "val_loss"
                        else f"-->>>> New {self.best_by} Record: {state['best_rouge']:.2f}")
        state.update(epoch=epoch, scheduler=self.scheduler.state_dict(),
                     scaler=self.scaler.state_dict() if self.scaler else None)
        if not (improved and self.folder):
            return None
        name = f"{self.run_name}-{epoch}" + (f"-{val_loss:.4f}" if val_loss is not None else "")
        state["best_checkpoint"] = os.path.join(self.folder, name)
        return state["best_checkpoint"]

    def export(self, path):
        """The model at path: gathered on rank 0, or written from every rank's shards."""
        if not self.full_state_dict:
            return export_shards(self.model, self.tokenizer, path)
        export_model(self.model, self.tokenizer, path, cpu_offload=self.cpu_offload)

    def save(self, path):
        """A resumable sharded checkpoint at path (checkpoint-epoch-N)."""
        save_sharded_checkpoint(self.model, self.optimizer, self.state, path)


# ------------------------------------------------------------------------------------------ main
def main(args, device):
    # 0. The flags and inputs, checked before any work (one line from rank 0 if they cannot).
    errors.agree_on_error(checks.flag_problem(args, device, dist.get_world_size(), TRAINER_STATE))
    workarounds.quiet_known_warnings()  # library warnings that say nothing a user can act on
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    torch.manual_seed(args.seed)
    sharded = args.save_model and args.checkpoint_type == "sharded"
    folder = t5_saves.t5_folder(args.save_dir, TRAINER_STATE)  # --save-dir, as the checks name it

    # 1. The model (LoRA: with adapters), tokenizer and data; each node's rank 0 loads first.
    name, from_rank0 = os.path.expanduser(args.model_name), args.cpu_ram_efficient_loading
    weights = checks.safetensors_to_read(name) if from_rank0 and args.fsdp_version == 2 else None
    on_meta = bool(weights) or (from_rank0 and dist.get_rank() > 0)  # see wrap_model, shard_model
    model, tokenizer = local_rank_zero_first(  # a model that cannot serve: one line
        lambda: checks.checked_model(load_model_and_tokenizer, name, on_meta))
    lora = checks.lora_settings(args)  # add_lora's settings; None: full fine-tuning
    model = add_lora(model, **lora) if lora else model  # LoRA: adapters beside the frozen weights
    train_set, val_set = local_rank_zero_first(lambda: load_data(
        tokenizer, args.data_dir, args.input_length, args.output_length, args.num_train_samples,
        args.num_val_samples if args.run_validation else None))
    train_loader = rank_loader(train_set, args.batch_size, device, shuffle=True, seed=args.seed)
    val_loader = rank_loader(val_set, args.test_batch_size, device) if val_set else None

    # 2. Shard the model, one unit per T5Block: FSDP1's wrapper, or FSDP2 (--fsdp-version 2).
    #    --compile: each block compiled first, in place (its names stay), as fsdp2_transformer.py.
    blocks = [*model.encoder.block, *model.decoder.block]  # (PEFT passes .encoder on)
    for block in blocks if args.compile else []:
        block.compile(dynamic=False)  # static: every batch padded to --input/--output-length
    strategy, precision = checks.sharding_choice(args, device)  # what this world and device allow
    mesh = device_mesh(device, hybrid=strategy == "HYBRID_SHARD")
    with workarounds.sharding_workarounds(model, device, weights=weights, from_rank0=from_rank0):
        if args.fsdp_version == 1:
            model = wrap_model(model, mesh, device, sharding_strategy=strategy,
                               mixed_precision=POLICIES[precision],
                               backward_prefetch=args.backward_prefetch,
                               limit_all_gathers=args.limit_all_gathers is not False,  # default on
                               activation_checkpointing=args.activation_checkpointing,
                               sync_module_states=from_rank0)
        else:
            model = shard_model(model, mesh, device, sharding_strategy=strategy,
                                mp_policy=POLICIES_FSDP2[precision],
                                activation_checkpointing=args.activation_checkpointing,
                                broadcast_from_rank0=from_rank0, weights=weights)
    log = EpochLog(args.metrics_json, device, save_dir=args.save_dir, rouge=args.rouge,
                   compile=args.compile, track_memory=args.track_memory,
                   dist_timeout=args.dist_timeout, max_tokens=args.max_tokens)
    log.begin(model, train_loader, val_loader)  # the data, memory after loading
    if args.fsdp_version == 1:  # what FSDP built, read from the model
        describe.describe_fsdp1(model)
    else:
        describe.describe_fsdp2(model, blocks)

    # 3. The optimizer after wrapping, over this rank's shards of what trains (LoRA: the adapters);
    #    fused on CUDA: one kernel steps every tensor.
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.AdamW(trained, lr=args.lr, fused=device.type == "cuda")
    if lora and args.fsdp_version == 1:  # FSDP1 leaves the adapters whole (wrap_model)
        optimizer.register_step_pre_hook(lambda *_: average_gradients(trained))
    errors.stop_on_non_finite_gradients(optimizer, DIVERGED)  # a diverged run stops at once
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    scaler = ShardedGradScaler(device=device.type) if precision == "fp16" else None

    # 4. The epochs' saves, and the resume (--resume) of the checkpoint rank 0 finds, unless its
    #    adapters (LoRA) were trained on another base; a failed read: one line on every rank.
    checkpointer = Checkpointer(
        args.save_dir if args.save_model else None, model, optimizer, scheduler, scaler, tokenizer,
        full_state_dict=args.full_state_dict or args.fsdp_version == 1,  # FSDP2: from its shards
        cpu_offload=workarounds.offload_to_cpu(model), best_by=args.best_metric,
        record={"lora": lora, "base": t5_saves.base_fingerprint(model)})  # what a resume must match
    path = t5_saves.find_resumable(args.resume, folder)
    if path:
        base = checkpointer.state["base"]  # LoRA: the frozen base it is trained on
        errors.agree_on_error(t5_saves.base_problem(path, TRAINER_STATE, base))
        with errors.in_one_line(f"--resume {path}: cannot load it", "it is corrupted, or was "
                                "saved for another model", every_rank=True):
            checkpointer.load(path)
    # --save-dir writable (made only now: bad input leaves nothing behind; --rouge writes its
    # summaries there), and locked for this job where it holds resumable checkpoints.
    outputs = folder.path if args.save_model or args.rouge else None
    checkpoints.check_outputs(args.metrics_json, {"--save-dir": outputs})
    if sharded:
        checkpoints.lock_folder("--save-dir", folder.path)
        t5_saves.remove_unfinished_exports(folder.path)
        if not args.resume and args.overwrite:  # (without it, flag_problem refused the folder)
            folder.overwrite()

    references = val_set.references(tokenizer) if args.rouge else None  # the targets, as text
    # 5. Per epoch: train, (--rouge) judge the summaries, validate, step the learning rate; save
    # the best model and a checkpoint.
    for epoch in log.epochs(range(checkpointer.state["epoch"] + 1, args.epochs + 1)):
        # Reseeded per epoch and rank: a resumed run's dropout draws what it would have drawn.
        torch.manual_seed(args.seed * 100_003 + epoch * 1_009 + dist.get_rank())
        train_loss = train(model, train_loader, optimizer, scaler, epoch, device,
                           max_tokens=args.max_tokens, bar=log.bar)
        log.trained()
        rouge = None
        if args.rouge:  # the summaries judged: each rank generates its share, ROUGE scores them
            policy = POLICIES[precision] if args.fsdp_version == 1 else POLICIES_FSDP2[precision]
            summaries = generate_summaries(
                model, val_loader, tokenizer, device, gather_once=args.generate == "gathered",
                dtype=policy.param_dtype, num_beams=args.num_beams,
                max_new_tokens=args.generation_max_length or args.output_length)
            rouge = rouge_scores(summaries, references)
            log.summaries(epoch, summaries, rouge, references=references,
                          run_name=checkpointer.run_name)  # its time; a few printed; a file
        val_loss = validation(model, val_loader, device, max_tokens=args.max_tokens,
                              bar=log.bar) if val_loader else None
        if val_loss is not None:
            errors.stop_if_diverged("the validation loss", [torch.tensor(val_loss)], DIVERGED)
        scheduler.step()
        log.epoch_done(epoch, model, optimizer)  # its time, and memory
        best = checkpointer.epoch_done(epoch, train_loss, val_loss, last=epoch == args.epochs,
                                       rouge=rouge)
        # Each save checked: never a diverged model, free space, a failed write in one line.
        if best:  # the best model so far: its full state dict and HF directory
            with t5_saves.checked_save(checkpointer, best, folder, DIVERGED):
                checkpointer.export(best)
        if sharded:  # every epoch, a checkpoint that --resume continues from
            path = os.path.join(folder.path, f"checkpoint-epoch-{epoch}")
            with t5_saves.checked_save(checkpointer, path, folder, DIVERGED, sharded=True):
                checkpointer.save(path)

    # 6. Report: throughput, time, memory, and the metrics file.
    log.done(model, optimizer, checkpointer, mixed_precision=precision, sharding_strategy=strategy)


def parse_args(argv=None):
    parser = RankZeroArgumentParser(
        description="PyTorch T5 FSDP fine-tuning example (WikiHow summarization)")
    on_off = argparse.BooleanOptionalAction
    add = parser.add_argument_group("model").add_argument
    add("--model-name", default="t5-base", help="hub id or save_pretrained directory of a T5")
    add = parser.add_argument_group("data").add_argument
    add("--data-dir", default="data", help="folder of wikihowAll.csv (and all_train/val/test.txt)")
    add("--num-train-samples", type=positive(int), default=1500, metavar="N", help="first N "
        "articles of the train split")
    add("--num-val-samples", type=positive(int), default=300, metavar="N", help="first N articles "
        "of the validation split")
    add("--input-length", type=positive(int, most=16384), default=512, metavar="N",
        help="article tokens (truncated or padded to N)")
    add("--output-length", type=positive(int, most=16384), default=150, metavar="N",
        help="summary tokens (truncated or padded to N; the loss ignores the padding)")
    add = parser.add_argument_group("training").add_argument
    add("--batch-size", type=positive(int), default=4, metavar="N", help="batch per process")
    add("--test-batch-size", type=positive(int), default=4, metavar="N", help="validation batch")
    add("--max-tokens", type=positive(int), metavar="N", help="cut each rank's batch into micro-"
        "batches of at most N tokens (source + target, padded to the micro-batch's longest, not to "
        "--input-length and --output-length), gradients added up; at least the sum of those two. "
        "Default: one batch, padded to them")
    add("--epochs", type=positive(int), default=2, metavar="N", help="number of epochs to train")
    add("--lr", type=positive(float, most=1e30), default=0.002, metavar="LR",
        help="AdamW learning rate, at most 1e30 (much larger ones overflow float32)")
    add("--gamma", type=positive(float, zero=True, most=1), default=0.7, metavar="M",
        help="learning rate step gamma per epoch")
    add("--seed", type=positive(int, zero=True, most=2**32 - 1), default=1, metavar="S",
        help="random seed (dropout, shuffling)")
    add("--run-validation", action=on_off, default=True,
        help="compute the validation loss every epoch (without: the last epoch's model is saved)")
    add = parser.add_argument_group("LoRA: train adapters, not the model's weights").add_argument
    add("--lora-rank", type=positive(int, zero=True), default=0, metavar="R", help="the adapters' "
        "rank (PEFT's r; 8-64 is usual); 0: full fine-tuning, every weight trained")
    add("--lora-alpha", type=positive(float), default=16, metavar="A", help="scales them: A / R")
    add("--lora-dropout", type=positive(float, zero=True, most=0.99), default=0.05, metavar="P",
        help="dropout on their input")
    add("--lora-targets", type=lambda text: text.split(","), default="q,v", metavar="NAMES",
        help="names of the Linear modules that get adapters (T5: q,k,v,o attention, wi,wo MLP)")
    add("--base-dtype", default="fp32", choices=list(BASE_DTYPES), help="the frozen base's "
        "dtype: bf16 halves its memory (the adapters stay fp32)")
    add = parser.add_argument_group("FSDP").add_argument
    add("--fsdp-version", type=int, default=1, choices=[1, 2], help="1: FSDP1's wrapper (the "
        "tutorial's); 2: FSDP2's fully_shard (README.md, 't5_fsdp_finetune.py on FSDP2')")
    add("--sharding-strategy", default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
        help="FULL_SHARD shards parameters, gradients and optimizer state (ZeRO-3; FSDP2: "
             "reshard_after_forward=True); SHARD_GRAD_OP keeps parameters gathered from forward "
             "to backward (ZeRO-2; False); NO_SHARD is DDP (FSDP1 only); HYBRID_SHARD shards "
             "within a node, replicates across nodes (FSDP2: a 2-D mesh)")
    add("--backward-prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST",
        "NONE"], help="when to all-gather the next unit's parameters in backward (FSDP2: PRE)")
    add("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "fp32", "grad-bf16"],
        help="auto: bf16 on GPUs with native bf16, else fp32 (also on CPU); bf16/fp16: compute, "
             "reduction and buffers in that dtype (fp16: a sharded grad scaler; FSDP2: bf16 "
             "reduces in fp32, no fp16); grad-bf16: reduction only; bf16 falls back to fp32 where "
             "unsupported")
    add("--activation-checkpointing", action="store_true",
        help="recompute each T5Block's activations in backward instead of storing them")
    add("--compile", action="store_true", help="torch.compile each T5Block before sharding, for "
        "one shape: fewer, fused kernels (FSDP2; the first steps compile; summaries: eager)")
    add("--limit-all-gathers", action=on_off, help="rate-limit FSDP1's all-gathers so that "
        "prefetching cannot exhaust GPU memory (default: on; FSDP2 limits its own, and refuses it)")
    add("--cpu-ram-efficient-loading", action="store_true",
        help="FSDP1: only rank 0 loads the weights, the others get them (sync_module_states); "
             "FSDP2: every rank reads its shards of the model's safetensors, none all of it")
    add = parser.add_argument_group("checkpointing").add_argument
    add("--save-model", action=on_off, default=True,
        help="save the model when the validation loss improves: the HF directory "
             "T5-model-<date>-<epoch>-<loss>-hf with the tokenizer (LoRA: merged; and the PEFT "
             "adapters ...-adapter) and the full state dict ...pt (--full-state-dict)")
    add("--full-state-dict", action=on_off, help="save from the whole model gathered on rank 0, "
        "with the .pt (default: on for FSDP1; FSDP2 writes the HF files from the ranks' shards)")
    add("--checkpoint-type", default="full", choices=["full", "sharded"],
        help="full: only the best model, gathered on rank 0; sharded: also a resumable DCP "
             "checkpoint (every rank writes its shards) per epoch: <save-dir>/checkpoint-epoch-N")
    add("--resume", metavar="DIR|auto",
        help="continue from a sharded checkpoint: a checkpoint-epoch-N directory, or a folder of "
             "them (its newest complete one); auto: the newest in --save-dir, if any (torchrun "
             "--max-restarts), else start afresh")
    add("--save-dir", default=".", help="folder for saved models and checkpoints")
    add("--overwrite", action="store_true", help="without --resume, delete the sharded "
        "checkpoints already in --save-dir")
    add = add_run_flags(parser)  # --cpu, --world-size, --dist-timeout, --metrics-json
    add("--track-memory", action=on_off, default=True, help="print peak memory every epoch")
    add = parser.add_argument_group("ROUGE: the summaries the model writes, judged").add_argument
    add("--rouge", action="store_true", help="after each epoch's training, each rank "
        "generates summaries of its share of the validation articles, scored with ROUGE-1/2/L/Lsum "
        f"(the rouge_score package: {ROUGE_INSTALL}); a few are printed, all written to "
        "<save-dir>/T5-model-<date>-<epoch>-predictions.jsonl, the scores to --metrics-json. Off "
        "by default: generating takes several times a validation pass")
    add("--num-beams", type=positive(int), default=1, metavar="N", help="beam search with N "
        "beams; 1: greedy")
    add("--generation-max-length", type=positive(int, most=16384), metavar="N",
        help="most tokens of a generated summary (default: --output-length)")
    add("--generate", default="gathered", choices=["gathered", "by-block"], help="gathered: each "
        "rank generates with a whole copy of the model, its parameters gathered once (memory: the "
        "model per rank; no communication per token); by-block: each block's parameters gathered "
        "in each of its forwards, as in training (memory: a block; all-gathers at every token, the "
        "ranks kept in step). --plan shows what each costs")
    add("--best-metric", default="val_loss", choices=["val_loss", *ROUGE_KEYS], help="what picks "
        "the best model, which is saved: the lowest validation loss, or the highest of a ROUGE "
        "score (with --rouge)")
    add_plan_flags(parser, PLAN_HELP)  # --plan: will it fit? (safeguards.t5_plan)
    return parser.parse_args(argv)


if __name__ == "__main__":
    # main on every rank, however the job was started; under torchrun --max-restarts with
    # --resume auto, each restart resumes from the newest checkpoint. --plan: each rank's memory,
    # predicted from the model's config alone, no training.
    args = parse_args()
    if args.plan:
        plan_and_exit(args, add_lora)
    launch(main, args, resume_hint=t5_saves.resume_hint(args, TRAINER_STATE),
           memory_advice=MEMORY_ADVICE,
           check=functools.partial(checks.flag_problem, marker=TRAINER_STATE))
