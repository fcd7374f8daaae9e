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

from summarization_dataset import rouge_scores, wikihow


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
    """After each epoch: the losses, the best model so far (lowest validation loss, or the last
    epoch's) exported into folder (None: no saves), with sharded a resumable checkpoint there."""

    def __init__(self, folder, model, optimizer, scheduler, scaler, tokenizer, full_state_dict=True,
                 sharded=False, best_by="val_loss"):
        self.folder, self.tokenizer = folder and os.path.abspath(folder), tokenizer
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.full_state_dict, self.sharded = scaler, full_state_dict, sharded
        self.best_by = best_by  # val_loss, or a ROUGE score: rouge1, rouge2, rougeL, rougeLsum
        now = [datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")]
        dist.broadcast_object_list(now)  # rank 0's: the ranks' clocks (to the second) may differ
        self.run_name = f"T5-model-{now[0]}"  # every rank writes its shards of an export there
        self.state = {"epoch": 0, "best_val_loss": None, "best_checkpoint": None,
                      "train_losses": [], "val_losses": []}

    def epoch_done(self, epoch, train_loss, val_loss, last, rouge=None):
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
        if improved and self.folder:
            name = f"{self.run_name}-{epoch}" + (f"-{val_loss:.4f}" if val_loss is not None else "")
            state["best_checkpoint"] = os.path.join(self.folder, name)
            self.export(state["best_checkpoint"])
        if self.sharded:
            state.update(epoch=epoch, scheduler=self.scheduler.state_dict(),
                         scaler=self.scaler.state_dict() if self.scaler else None)
            self.save(os.path.join(self.folder, f"checkpoint-epoch-{epoch}"))

    def export(self, path, cpu_offload=True):  # gathered on rank 0, or from every rank's shards
        if not self.full_state_dict:
            return export_shards(self.model, self.tokenizer, path)
        export_model(self.model, self.tokenizer, path, cpu_offload=cpu_offload)

    def save(self, path):  # the sharded checkpoint (CheckedCheckpointer checks around it)
        save_sharded_checkpoint(self.model, self.optimizer, self.state, path)


# ------------------------------------------------------------------------------------------ main
def main(args, device):
    torch.manual_seed(args.seed)
    quiet_known_warnings()  # library warnings and bars that say nothing a user can act on

    # 1. The model (LoRA: with adapters), tokenizer and data; each node's rank 0 loads first.
    name, from_rank0 = os.path.expanduser(args.model_name), args.cpu_ram_efficient_loading
    weights = safetensors_to_read(name) if from_rank0 and args.fsdp_version == 2 else None
    on_meta = bool(weights) or (from_rank0 and dist.get_rank() > 0)  # see wrap_model, shard_model
    model, tokenizer = local_rank_zero_first(lambda: checked_model(name, on_meta))
    lora = check_lora_flags(args)  # the settings of --lora-*; None: full fine-tuning
    model = add_lora(model, **lora) if lora else model  # LoRA: adapters beside the frozen weights
    train_set, val_set = local_rank_zero_first(lambda: load_data(
        tokenizer, args.data_dir, args.input_length, args.output_length, args.num_train_samples,
        args.num_val_samples if args.run_validation else None))
    train_loader = rank_loader(train_set, args.batch_size, device, shuffle=True, seed=args.seed)
    val_loader = rank_loader(val_set, args.test_batch_size, device) if val_set else None

    # 2. Shard the model, one unit per T5Block: FSDP1's wrapper, or FSDP2 (--fsdp-version 2).
    #    --compile: each block compiled first, in place (its names stay), as fsdp2_transformer.py.
    for block in (*model.encoder.block, *model.decoder.block) if args.compile else []:
        block.compile(dynamic=False)  # static: every batch padded to --input/--output-length
    strategy, precision = check_sharding_flags(args, device)  # what this world and device allow
    mesh = device_mesh(device, hybrid=strategy == "HYBRID_SHARD")
    with sharding_workarounds(model, device, weights=weights, from_rank0=from_rank0):
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
    log = EpochLog(args, device).begin(model, train_loader, val_loader)  # FSDP's units, memory

    # 3. The optimizer after wrapping, over this rank's shards of what trains (LoRA: the adapters);
    #    fused on CUDA: one kernel steps every tensor.
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.AdamW(trained, lr=args.lr, fused=device.type == "cuda")
    if lora and args.fsdp_version == 1:  # FSDP1 leaves the adapters whole (wrap_model)
        optimizer.register_step_pre_hook(lambda *_: average_gradients(trained))
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    scaler = ShardedGradScaler(device=device.type) if precision == "fp16" else None

    # 4. The epochs' saves, and the resume: the lesson's Checkpointer, with the safeguards' checks.
    checkpointer = CheckedCheckpointer(
        args.save_dir if args.save_model else None, model, optimizer, scheduler, scaler, tokenizer,
        sharded=args.checkpoint_type == "sharded", lora=lora, best_by=args.best_metric,
        full_state_dict=args.full_state_dict or args.fsdp_version == 1)  # FSDP2: from its shards
    checkpointer.load(args.resume)
    check_before_training(args)  # --save-dir writable and locked; --overwrite

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
        scheduler.step()
        log.epoch_done(epoch, model, optimizer)  # its time, and memory
        checkpointer.epoch_done(epoch, train_loss, val_loss, last=epoch == args.epochs, rouge=rouge)

    # 6. Report: throughput, time, memory, and the metrics file.
    log.done(model, optimizer, checkpointer, mixed_precision=precision)


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
    add = add_run_flags(parser)  # --cpu, --world-size, --dist-timeout, --metrics-json (safe_launch)
    add("--track-memory", action=on_off, default=True, help="print peak memory every epoch")
    add_rouge_flags(parser)  # --rouge: generated summaries judged (below the safeguards)
    add_plan_flags(parser, PLAN_HELP)  # --plan: will it fit? (the planner, below the safeguards)
    return exit_if_plan(parser.parse_args(argv))  # --plan prints the memory plan and exits


# ==================================================================================================
# Safeguards, not part of the lesson: this script's checks (flags, inputs, checkpoints, folders),
# exceptions turned into one line, labelled workarounds, and its memory lines and progress bars.
# ==================================================================================================

# What the safeguards and the plumbing use besides the lesson's imports.
import glob
import importlib
import sys
import warnings

import huggingface_hub
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import _init_utils as fsdp_init_utils
from transformers.utils import logging as hf_logging

from safe_launch import (
    PLAN_RANKS,
    PROGRESS,
    LockStep,
    RankZeroArgumentParser,
    Report,
    Script,
    add_plan_flags,
    add_run_flags,
    agree_on_error,
    aligned,
    check_compile,
    check_outputs,
    fail,
    folder_number,
    full_state_bytes,
    launch,
    local_rank_zero_first,
    lock_folder,
    newest_complete,
    offload_to_cpu,
    plan_sizes,
    positive,
    print_plan,
    saving,
    state_bytes,
    stop_if_diverged,
    stop_on_non_finite_gradients,
    strategy_to_use,
)
from summarization_dataset import (
    DOWNLOAD_HELP,
    ROUGE_INSTALL,
    ROUGE_KEYS,
    WikiHowError,
    check_csv,
)

ELSEWHERE = "pass another --save-dir"  # where else a save can go, when a disk is full


def resume_hint(args):
    """Where a rerun resumes: the plumbing says it when Ctrl-C or SIGTERM stops the run."""
    if not (args.save_model and args.checkpoint_type == "sharded"):
        return "no resumable checkpoints (--checkpoint-type full): a rerun starts from epoch 1"
    return rerun_resumes(os.path.abspath(args.save_dir))


def rerun_resumes(folder):
    """Which checkpoint of folder a rerun resumes from (said when a save fails or the run stops)."""
    newest = newest_complete(folder, "checkpoint-epoch-", TRAINER_STATE)
    if newest is None:
        return f"no complete checkpoint in --save-dir {folder} yet: a rerun starts from epoch 1"
    return (f"the last complete checkpoint is epoch {folder_number(newest, 'checkpoint-epoch-')} "
            f"({newest}): run the same command with --resume auto to resume")


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


def check_fsdp2_flags(args):
    """Refuse, in one line, a flag that --fsdp-version 2 has no equivalent for (NOT_IN_FSDP2)."""
    for (flag, value), instead in NOT_IN_FSDP2.items() if args.fsdp_version == 2 else ():
        if getattr(args, flag) == value:
            fail(f"--fsdp-version 2 has no {instead}")


# What the plumbing's one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or --mixed-precision bf16 or fp32 instead of fp16"
MEMORY_ADVICE = ("use a smaller --batch-size, --test-batch-size, --input-length or "
                 "--output-length, or --activation-checkpointing")


def check_flags(args, device, world_size):
    """The checks that need no process group, which the plumbing runs in each process before it
    starts one: flag combinations, then the local inputs, so that what is missing (data, model
    directory) is said in one line at once, before the hub is tried (its retries take 30 s);
    then what --resume and --save-dir hold. Those that need the ranks: check_before_training."""
    if args.checkpoint_type == "sharded" and not args.save_model:
        fail("--checkpoint-type sharded writes checkpoints; --no-save-model turns them off")
    if args.resume == "auto" and args.checkpoint_type != "sharded":
        fail("--resume auto resumes from the checkpoints of --checkpoint-type sharded")
    check_fsdp2_flags(args)
    check_rouge_flags(args)
    if args.compile and args.fsdp_version == 1:  # (torch 2.14: dynamo breaks each graph there)
        fail("--compile: torch.compile cannot trace FSDP1's units (flat parameters, "
             "use_orig_params=False: every block would run eagerly); use --fsdp-version 2")
    if args.compile and args.max_tokens:
        fail("--compile compiles each block for one shape (--input-length, --output-length); "
             "--max-tokens cuts micro-batches of other lengths, each compiled anew: drop one")
    if args.compile:  # fail now, in one line, rather than at the first step
        check_compile(device)
    lora = check_lora_flags(args)
    longest = args.input_length + args.output_length  # an example's tokens at most
    if args.max_tokens is not None and args.max_tokens < longest:  # micro-batches of at most N
        fail(f"--max-tokens {args.max_tokens} is less than --input-length + --output-length "
             f"({longest}), the tokens of the longest example; pass at least {longest}")
    if args.full_state_dict is False and args.fsdp_version == 1:
        fail("--no-full-state-dict: FSDP1 writes its HF files from the full state dict; FSDP2 "
             "(--fsdp-version 2) writes them from every rank's shards")
    name = os.path.expanduser(args.model_name)
    csv_path = os.path.join(args.data_dir, "wikihowAll.csv")
    missing = [] if os.path.isfile(csv_path) else [f"{csv_path} not found: {DOWNLOAD_HELP}"]
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~"))):
        missing.append(f"--model-name {name}: no such directory; pass a directory written by "
                       "save_pretrained (config.json, model weights, tokenizer files) or a hub id "
                       "such as t5-base")
    elif not os.path.isdir(name) and (problem := hub_problem(name)):
        missing.append(problem)
    if missing:
        fail("; and ".join(missing))
    try:  # their first lines: a wrong file or folder is refused before any process loads it
        check_csv(args.data_dir)
    except WikiHowError as e:
        fail(str(e))
    if os.path.isdir(name) and (problem := model_folder_problem(name)):
        fail(f"cannot load a T5 model and tokenizer from the directory {name} ({problem}); pass "
             "--model-name with a directory written by save_pretrained, or a hub id")
    if args.lora_rank and (problem := lora_targets_problem(name, args.lora_targets)):
        fail(problem)
    problem = resume_problem(args.resume, args.save_dir, args.epochs, args.overwrite,
                             sharded=args.save_model and args.checkpoint_type == "sharded",
                             lora=lora)
    if problem:
        fail(problem)


def add_rouge_flags(parser):
    """--rouge and how its summaries are generated (generate_summaries, rouge_scores)."""
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


def check_rouge_flags(args):
    """--rouge and its options: what cannot work, refused in one line."""
    if args.rouge and not args.run_validation:
        fail("--rouge scores summaries of the validation articles; --no-run-validation turns "
             "validation off")
    if args.rouge:
        try:
            importlib.import_module("rouge_score")
        except ImportError:
            fail(f"--rouge needs the rouge_score package, which is not installed: {ROUGE_INSTALL}")
    needs_rouge = [flag for flag, value, default in (
        ("--num-beams", args.num_beams, 1), ("--generation-max-length",
                                             args.generation_max_length, None),
        ("--generate", args.generate, "gathered"), ("--best-metric", args.best_metric,
                                                    "val_loss")) if value != default]
    if needs_rouge and not args.rouge:
        fail(f"{', '.join(needs_rouge)}: for the summaries that --rouge generates; add --rouge")


def check_lora_flags(args):
    """The LoRA flags that cannot work, refused in one line; returns their settings (add_lora's
    keyword arguments), or None for full fine-tuning. A LoRA run records them in its checkpoints:
    a resume must train the same adapters (resume_problem)."""
    if args.base_dtype != "fp32" and not args.lora_rank:
        fail(f"--base-dtype {args.base_dtype} stores the frozen base of LoRA; add --lora-rank, or "
             "for full fine-tuning use --mixed-precision bf16 (which keeps fp32 master weights)")
    if args.base_dtype == "bf16" and args.mixed_precision == "fp16":
        fail("--base-dtype bf16 with --mixed-precision fp16 would cast the bf16 base to fp16, "
             "whose range is smaller; use --mixed-precision bf16 or fp32")
    if not args.lora_rank:
        return None
    return {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
            "targets": sorted(args.lora_targets), "base_dtype": args.base_dtype}


def lora_targets_problem(name, targets):
    """Why --lora-targets would not find its modules in the model --model-name names (read from
    its config.json alone, the model built on the meta device), or None. PEFT finds a target by
    the last parts of a module's name: "q" is every attention's q."""
    try:
        config = AutoConfig.from_pretrained(name)
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


def resume_problem(resume, save_dir, epochs, overwrite, sharded, lora=None):
    """Why the checkpoint --resume names (auto: the newest in --save-dir) cannot be resumed, or
    why --save-dir, without --resume, must not be written into; None if nothing is wrong. Read
    from the files alone, before a model is loaded: a resumed run must have epochs left, and a new
    run must not leave its checkpoints beside an earlier run's, which a later --resume auto would
    take for its own (--overwrite deletes them, the Hugging Face convention)."""
    if resume is None:
        old = sorted(glob.glob(os.path.join(save_dir, "checkpoint-epoch-*")))
        if not (sharded and old) or overwrite:
            return None
        return (f"--save-dir {save_dir} holds checkpoints of an earlier run "
                f"({os.path.basename(old[-1])}...), which a later resume would mix with this "
                "run's; add --resume auto to continue it, add --overwrite to delete them, or pass "
                "another --save-dir")
    checkpoint = resume_target(resume, save_dir)
    if checkpoint is None:
        return None if resume == "auto" else (
            f"--resume {resume}: no complete checkpoint of this script in it (a directory with "
            f"{TRAINER_STATE}, or one holding checkpoint-epoch-N directories; *.tmp ones are "
            "incomplete)")
    checkpoint = os.path.abspath(checkpoint)
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE)) as f:
            saved = json.load(f)
        epoch = saved.get("epoch")
    except (OSError, ValueError, AttributeError) as e:
        return (f"--resume {checkpoint}: cannot load it ({reason_line(e)}); it is corrupted, or "
                "was saved for another model")
    folder = folder_number(checkpoint, "checkpoint-epoch-")
    if not (isinstance(epoch, int) and epoch >= 1) or folder not in (None, epoch):
        return (f"--resume {checkpoint}: cannot load it (its {TRAINER_STATE} says epoch "
                f"{epoch!r}, not its folder's); it is corrupted, or was saved for another model")
    if epoch >= epochs:
        return (f"--resume: the checkpoint {checkpoint} has finished epoch {epoch} of --epochs "
                f"{epochs}; raise --epochs to train further")
    if saved.get("lora") != lora:  # what it holds: adapters of that LoRA, or every weight
        return (f"--resume {checkpoint}: it was saved by {lora_flags(saved.get('lora'))}, not "
                f"{lora_flags(lora)}; pass the flags it was saved with, or start afresh (without "
                "--resume, in another --save-dir)")
    return None


def lora_flags(lora):
    """LoRA settings (check_lora_flags) as the flags that make them; None: full fine-tuning."""
    if not lora:
        return "full fine-tuning"
    flags = {"rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
             "targets": "--lora-targets", "base_dtype": "--base-dtype"}
    return " ".join(f"{flags[key]} {','.join(value) if isinstance(value, list) else value}"
                    for key, value in lora.items())


def model_folder_problem(name):
    """Why the directory --model-name holds no T5 model, read from its config.json, or None (the
    loader says what else is wrong: check_model)."""
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
            return (f"{where}, and {endpoint} cannot be reached ({reason_line(e)}); pass a "
                    "directory written by save_pretrained, or run where the hub is reachable")
        rank0_print(f"{endpoint} cannot be reached: --model-name {name} loads from the cache after "
                    "the hub client's retries (HF_HUB_OFFLINE=1 skips them)")
    return None


def check_model(config, tokenizer):
    """Refuse a model that would train quietly wrong: not a T5, or without its own tokenizer."""
    if config.model_type != "t5":
        raise ValueError(f"it holds a {config.model_type} model, not T5")
    # Without its tokenizer files, T5Tokenizer quietly builds an almost empty vocabulary that
    # maps every word to <unk>: a model then learns nothing, with losses that look fine.
    if not 0.9 * config.vocab_size <= len(tokenizer) <= config.vocab_size:
        raise ValueError(f"its tokenizer has {len(tokenizer)} tokens for a model of "
                         f"{config.vocab_size} embeddings: tokenizer files are missing or belong "
                         "to another model")


def checked_model(name, on_meta):
    """load_model_and_tokenizer(name, on_meta), any failure turned into one line naming
    --model-name and the fix (a ValueError); a model that is not a T5 with its own tokenizer,
    which would train quietly wrong, refused."""
    with model_errors(name):
        model, tokenizer = load_model_and_tokenizer(name, on_meta)
        check_model(model.config, tokenizer)
    return model, tokenizer


@contextlib.contextmanager
def checked_save(model, path, needed, sharded=False):
    """Around a save of model to path (needed: the bytes this rank's part of it takes): never a
    model that is not finite; then the free space checked and a failed write in one line (of a
    sharded checkpoint: with where a rerun resumes)."""
    stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)
    resumes = f"; {rerun_resumes(os.path.dirname(path))}" if sharded else ""
    with saving(path, needed, ELSEWHERE + resumes, sharded=sharded):
        yield


class CheckedCheckpointer(Checkpointer):
    """The lesson's Checkpointer with the safeguards around it. A diverged run stops in one line
    before anything of it is saved: at once at a non-finite gradient, at a non-finite validation
    loss, at a non-finite parameter before a save (checked_save, which also checks the free space
    and turns a failed write into one line). A sharded save first removes what a crash left under
    its temporary name. load takes --resume's value and resumes from the checkpoint that rank 0
    finds, unless its adapters (LoRA) were trained on another base; a read that fails on any rank
    stops every rank in one line. lora: the LoRA settings, which the trainer state records."""

    def __init__(self, *positional, lora=None, **options):
        super().__init__(*positional, **options)
        self.state["lora"] = lora  # which a resume must match (resume_problem)
        stop_on_non_finite_gradients(self.optimizer, DIVERGED)

    def epoch_done(self, epoch, train_loss, val_loss, last, rouge=None):
        if val_loss is not None:
            stop_if_diverged("the validation loss", [torch.tensor(val_loss)], DIVERGED)
        super().epoch_done(epoch, train_loss, val_loss, last=last, rouge=rouge)

    def export(self, path):
        # Rank 0 writes the full state dict twice (the .pt, the HF files): its bytes are FSDP1's
        # units' unsharded sizes (full_state_bytes), or the global size of FSDP2's DTensors.
        full = (full_state_bytes(self.model) if isinstance(self.model, FSDP)
                else sum(p.numel() * p.element_size() for p in self.model.parameters()))
        with checked_save(self.model, path, 2 * full):
            super().export(path, cpu_offload=offload_to_cpu(self.model))

    def save(self, path):
        if dist.get_rank() == 0:  # the leftover of a crash, among whose files DCP would write
            shutil.rmtree(f"{path}.tmp", ignore_errors=True)
        dist.barrier()
        # What this rank writes: its shards of what trains (not a LoRA base) and of the optimizer.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        needed = state_bytes(trained) + state_bytes(list(self.optimizer.state.values()))
        with checked_save(self.model, path, needed, sharded=True):
            super().save(path)

    def load(self, resume):
        """resume: --resume's value (a checkpoint-epoch-N, a folder of them, auto: --save-dir;
        None: start afresh), checked by check_flags (resume_problem). The trainer state records
        the frozen base's fingerprint (LoRA; None without), which a resume must match."""
        self.state["base"] = base_fingerprint(self.model)
        path = find_resumable(resume, self.folder)
        if path:
            with checkpoint_errors(path, base=self.state["base"]):
                self.state = load_sharded_checkpoint(path, self.model, self.optimizer,
                                                     self.scheduler, self.scaler)


def model_errors(name):
    """Any failure to load --model-name becomes a ValueError of one line naming it and the fix."""
    where = (f"the directory {name}" if os.path.isdir(name)
             else f"{name!r} (no such directory; tried the hub)")
    return errors_in_one_line(f"cannot load a T5 model and tokenizer from {where}",
                              "pass --model-name with a save_pretrained directory, or a hub id on "
                              "a machine with network")


@contextlib.contextmanager
def errors_in_one_line(what, advice, every_rank=False):
    """An exception in the block becomes one line, '<what> (<its reason>); <advice>': a ValueError
    raised, or, with every_rank (all ranks run the block), a fail() on every rank if any failed."""
    error = None
    try:
        yield
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        error = f"{what} ({reason_line(e).split('. ')[0][:300]}); {advice}"
        if not every_rank:
            raise ValueError(error) from None
    if every_rank:
        agree_on_error(error)


@contextlib.contextmanager
def checkpoint_errors(path, base):
    """Any rank failing to read the checkpoint at path ends every rank, with one line; so do
    adapters (LoRA) saved for another base than this run's (base: its base_fingerprint), whose
    losses would be meaningless: checked before anything is read."""
    with open(os.path.join(path, TRAINER_STATE)) as f:
        saved = json.load(f).get("base")
    if base is not None and not math.isclose(saved or 0, base, rel_tol=1e-9):
        fail(f"--resume {path}: its adapters were trained on another base model than --model-name "
             f"(fingerprint {saved!r}, not {base!r}); pass the --model-name it was trained with, "
             "or start afresh without --resume")
    with errors_in_one_line(f"--resume {path}: cannot load it", "it is corrupted, or was saved "
                            "for another model", every_rank=True):
        yield


def base_fingerprint(model):
    """A number that identifies the frozen weights of a LoRA run (None without any): the sum, over
    its tensors, of each one's float64 sum weighted by its place in the state dict. Saved with
    each checkpoint, so that adapters are never resumed onto another base. The sums of shards are
    reduced across ranks (DTensor's full_tensor), so any world size and sharding give the same
    number, to about 1e-15."""
    trained = get_model_state_dict(model, options=StateDictOptions(
        ignore_frozen_params=True)).keys()
    total, found = 0.0, False
    for place, (name, tensor) in enumerate(sorted(get_model_state_dict(model).items()), 1):
        if name in trained:
            continue
        tensor_sum = tensor.sum(dtype=torch.float64)  # a DTensor's is partial: full_tensor sums
        total += place * (tensor_sum.full_tensor() if isinstance(tensor_sum, DTensor)
                          else tensor_sum).item()
        found = True
    return total if found else None


def reason_line(error):
    """The last line of an exception's message, where the reason is, without a final period."""
    lines = str(error).strip().splitlines()
    return " ".join(lines[-1].split()).rstrip(".") if lines else type(error).__name__


def quiet_known_warnings():
    """Silence what says nothing a user can act on; each filter matches one message (torch 2.14,
    transformers 5). Remove a filter when its warning no longer shows in tests/test_t5.py's runs
    of every --sharding-strategy and --fsdp-version (they assert that no warning is printed)."""
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    # FSDP1's optimizer state-dict code calls a torch-internal helper that warns about its own
    # deprecation (_get_pg_default_device, and its "Multiple backends are registered").
    # FSDP1 under NO_SHARD warns at every sharded state dict, saved or loaded, that it returns a
    # full one (when loaded, torch 2.14 and 2.15 spell it "willbe": hence " ?").
    # FSDP1 deprecates NO_SHARD in favour of DistributedDataParallel, with a FutureWarning per
    # FSDP unit; the strategy works and is the tutorial's (and what one process falls back to):
    # remove this filter when torch removes NO_SHARD, and the choice from --sharding-strategy.
    warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are "
                            r"registered|full_state_dict will ?be returned|The `NO_SHARD` sharding "
                            r"strategy is deprecated)")
    # FSDP2 warns that a T5Block returns a view (its position bias, which the next blocks reuse):
    # an in-place op on it would skip FSDP2's pre-backward hook. T5 (transformers 5) only adds it
    # out of place, and FSDP2's losses equal FSDP1's (tests/test_t5.py): nothing is wrong.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(T5Block|"
                            r"CheckpointWrapper)\) returned a view tensor")
    # PEFT (0.21) reads transformers' deprecated is_gradient_checkpointing while it adds adapters,
    # which transformers 5 answers with a FutureWarning to the user. Remove when PEFT reads
    # is_activation_checkpointing (the LoRA runs of tests/test_t5.py assert no warning).
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")


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


def check_sharding_flags(args, device):
    """The sharding strategy and mixed precision that this world and device allow: (FSDP1)
    strategy_to_use's NO_SHARD where there is nothing to shard over (one process, or one per node
    under HYBRID_SHARD), and mixed_precision_choice's policy."""
    strategy = args.sharding_strategy
    if args.fsdp_version == 1:
        strategy = strategy_to_use(strategy)
    return strategy, mixed_precision_choice(args.mixed_precision, device)


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


@contextlib.contextmanager
def sharding_workarounds(model, device, weights, from_rank0):
    """Around the call that shards model (wrap_model, shard_model): the labelled workarounds it
    needs, each below; what they patch in torch is restored when the call returns. weights: the
    folder of safetensors that FSDP2's ranks read shard by shard (None: as loaded, or from rank 0);
    from_rank0: only rank 0's model has weights (--cpu-ram-efficient-loading)."""
    untie_as_the_weights(model, weights)
    with allow_sync_module_states_on_cpu(from_rank0 and device.type == "cpu"):
        yield


def untie_as_the_weights(model, weights):
    """Workaround: transformers 5 (5.0 to 5.23 at least) ties T5's lm_head to the embedding in a
    model built from its config (T5Config forces tie_word_embeddings=True) and unties it in
    from_pretrained only when the checkpoint holds two different tensors, as flan-t5's and T5
    v1.1's do. With --cpu-ram-efficient-loading, the ranks that build on the meta device would hold
    one parameter fewer than rank 0, and FSDP's broadcast of rank 0's weights aborts ("Received
    data size doesn't match expected size"); read shard by shard (weights, a folder), the lm_head
    would be the embedding. Rank 0 (or the files: an lm_head.weight of its own) says whether the
    lm_head is its own; the others untie theirs to match. Remove when T5Config keeps
    tie_word_embeddings=False."""
    untied = [model.lm_head.weight is not model.shared.weight]
    if weights:
        metadata = HuggingFaceStorageReader(weights).read_metadata().state_dict_metadata
        untied = ["lm_head.weight" in metadata]
    dist.broadcast_object_list(untied, src=0)
    if untied[0] and model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight),
                                                  requires_grad=model.shared.weight.requires_grad)


@contextlib.contextmanager
def allow_sync_module_states_on_cpu(needed):
    """Workaround: FSDP1 (torch 2.14) refuses sync_module_states for CPU tensors, assuming NCCL,
    although gloo broadcasts them ("ValueError: The module has CPU parameters or buffers when
    `sync_module_states=True`, which requires them to be on GPU"); while FSDP1 wraps a CPU model
    (needed), this skips that one private check, torch.distributed.fsdp._init_utils.
    _check_module_states_for_sync_module_states (FSDP2 has none), and restores it after. Remove it
    when FSDP1 lets gloo runs sync CPU modules (tests/test_t5.py's cpu_ram_efficient_loading
    tests pass without it)."""
    check = fsdp_init_utils._check_module_states_for_sync_module_states
    if needed:
        fsdp_init_utils._check_module_states_for_sync_module_states = lambda states: None
    try:
        yield
    finally:
        fsdp_init_utils._check_module_states_for_sync_module_states = check


def compiled_graphs():
    """How many graphs torch.compile has compiled in this process (dynamo's private counters: no
    public call counts them)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def describe_fsdp(model):
    """Print what FSDP built, read from the wrapped model itself rather than from the flags; the
    sizes per unit come from FSDP1's private _flat_param (no public call gives them)."""
    if not isinstance(model, FSDP):
        return describe_fsdp2(model)
    dtypes = [str(d).replace("torch.", "") for d in vars(model.mixed_precision).values()][:3]
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    units = len(FSDP.fsdp_modules(model))
    rank0_print(f"FSDP built {units} unit{'s' * (units != 1)}: "
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
    flats = [flat for unit in FSDP.fsdp_modules(model) if (flat := unit._flat_param) is not None]
    whole = [p for p in model.parameters() if not any(p is flat for flat in flats)]
    if whole:
        rank0_print(f"  {len(whole)} LoRA adapter matrices, {sum(p.numel() for p in whole):,} "
                    "parameters: whole on every rank, gradients averaged in one all-reduce")
    describe_lora([(flat._unpadded_unsharded_size.numel(), flat.requires_grad, flat.dtype)
                   for flat in flats] + [(p.numel(), p.requires_grad, p.dtype) for p in whole])


def describe_lora(parameters):
    """With LoRA, how many of the (numel, requires_grad, dtype) parameters train, and the frozen
    base's dtype; nothing for full fine-tuning."""
    trained = sum(numel for numel, requires_grad, _ in parameters if requires_grad)
    total = sum(numel for numel, _, _ in parameters)
    frozen = {str(dtype).replace("torch.", "") for _, requires_grad, dtype in parameters
              if not requires_grad}
    if frozen:
        rank0_print(f"LoRA: {trained:,} of {total:,} parameters train ({100 * trained / total:.2f}"
                    f"%), the adapters; the base is frozen, in {', '.join(sorted(frozen))}")


def describe_fsdp2(model):
    """describe_fsdp for fully_shard: its groups, their mesh, and the settings of the first
    block's group, read from FSDP2's private group state (no public call gives them)."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    first = groups[0]._get_fsdp_state()._fsdp_param_group  # private: the group's settings
    param = first.fsdp_params[0]
    policy = getattr(param, "mp_policy", None) or first.mp_policy  # torch 2.15: per parameter
    dtypes = [str(d).replace("torch.", "") for d in (policy.param_dtype, policy.reduce_dtype)]
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    mesh = tuple(param.sharded_param.device_mesh.shape)
    rank0_print(f"FSDP2 sharded {len(groups)} groups on a {mesh} mesh: reshard_after_forward "
                f"{first.post_forward_mesh_info is not None}, mixed precision param {dtypes[0]} "
                f"reduce {dtypes[1]} (None: not cast), activation checkpointing of "
                f"{checkpointed} T5Blocks")
    sizes = {}  # (kind of group, parameters, on rank 0) -> how many groups
    for group in groups:
        params = [p.sharded_param for p in group._get_fsdp_state()._fsdp_param_group.fsdp_params]
        key = (type(group).__name__.removeprefix("FSDP"), sum(p.numel() for p in params),
               sum(p.to_local().numel() for p in params))
        sizes[key] = sizes.get(key, 0) + 1
    for (kind, total, local), count in sizes.items():
        rank0_print(f"  {count} x {kind}: {total:,} parameters each, {local:,} on rank 0")
    describe_lora([(p.numel(), p.requires_grad, p.dtype) for p in model.parameters()])


class EpochLog(Report):
    """The plumbing's Report (time, memory, --metrics-json) with this script's lines: what FSDP
    built and each rank's memory once loaded; each epoch's time (training alone, then with
    validation) and, with --track-memory, the ranks' peak memory; at the end samples/s and the
    summary. Its bar is train's and validation's progress bar."""

    def begin(self, model, train_loader, val_loader):
        """Print the sizes of the data, what FSDP built (describe_fsdp) and each rank's peak memory
        so far: what loading and wrapping the model cost it. Returns the log."""
        self.train_loader, self.val_loader = train_loader, val_loader
        self.train_times, self.epoch_times, self.generated, self.graphs = [], [], [], []
        if self.args.rouge:  # nltk (2 s, with scipy) imported now, not in epoch 1's ROUGE time
            importlib.import_module("rouge_score.rouge_scorer")
        # bar's: ranks kept in step; with --max-tokens also in each step's forwards (a rank's count
        # varies there), which costs a check-in each. Made first, before "FSDP built": once, a peer
        # stopped then (tests/test_faults.py's hung peer) left rank 0 in the new group's set-up
        # past --dist-timeout (torch 2.14, gloo); made before, the test's stop comes after it.
        self.lock_step = LockStep(self.args.dist_timeout,
                                  model=model if self.args.max_tokens else None)
        rank0_print(f"Size of train dataset: {len(train_loader.dataset)}, validation dataset: "
                    f"{len(val_loader.dataset) if val_loader else 'none (--no-run-validation)'}")
        describe_fsdp(model)
        if self.args.compile:
            blocks = [m for m in model.modules() if isinstance(m, T5Block)]
            compiled = sum(block._compiled_call_impl is not None for block in blocks)  # private
            rank0_print(f"Blocks compiled: {compiled} of {len(blocks)} (torch.compile, in place)")
        self.memory(model)
        self.loaded = self.peaks  # for --metrics-json
        rank0_print("Peak memory per rank after loading the model: "
                    + ", ".join(f"{peak / 2**20:.1f}" for peak in self.peaks) + " MiB")
        return self

    def trained(self):
        self.train_times.append(self.lap())

    def epoch_done(self, epoch, model, optimizer):
        self.epoch_times.append(self.train_times[-1] + self.lap())
        rank0_print(f"Epoch {epoch} time: {self.epoch_times[-1]:.2f}s")
        if self.args.compile:  # those of the first epoch (training, validation); later, none
            self.graphs.append(compiled_graphs() - sum(self.graphs))
            rank0_print(f"Graphs compiled in epoch {epoch}: {self.graphs[-1]}"
                        + (" (a recompile: a new shape or mode)" if epoch > 1 and self.graphs[-1]
                           else ""))
        if self.args.track_memory:
            kind = "CUDA allocated" if self.device.type == "cuda" else "process RSS"
            rank0_print(f"Peak memory per rank ({kind}): "
                        f"{self.memory(model, optimizer)[1] / 2**20:.1f} MiB")

    def summaries(self, epoch, summaries, rouge, references, run_name):
        """After generate_summaries and rouge_scores: their time and the scores, three articles
        with their summaries; rank 0 writes every one (title, article, reference, generated) to
        <--save-dir>/<run_name>-<epoch>-predictions.jsonl, under a temporary name first."""
        seconds, articles = self.lap(), self.val_loader.dataset.articles
        rank0_print("ROUGE-1 {rouge1:.2f}, ROUGE-2 {rouge2:.2f}, ROUGE-L {rougeL:.2f}, ROUGE-Lsum "
                    "{rougeLsum:.2f}".format(**rouge) + f" ({len(summaries)} summaries generated "
                    f"in {seconds:.2f}s: {seconds / len(summaries):.3f}s each)")
        for (title, text, _), reference, summary in zip(articles[:3], references, summaries):
            rank0_print(f"  {title}: {text[:120]}...\n    reference: {reference}\n"
                        f"    generated: {summary}")
        path = os.path.join(os.path.abspath(self.args.save_dir),
                            f"{run_name}-{epoch}-predictions.jsonl")
        self.generated.append({"epoch": epoch, **rouge, "seconds": seconds, "predictions": path,
                               "seconds_per_summary": seconds / len(summaries)})
        if dist.get_rank() == 0:
            with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                for (title, text, _), reference, summary in zip(articles, references, summaries):
                    f.write(json.dumps({"title": title, "article": text, "reference": reference,
                                        "generated": summary}) + "\n")
            os.replace(f"{path}.tmp", path)
        self.lap()  # the file's time: not the next epoch's

    def epochs(self, numbers):
        """The epochs' numbers, timed from the first (not the loading and resuming before it),
        each without the saves after its validation."""
        self.restart()
        for number in numbers:
            yield number
            self.lap()  # the saves' time, not the next epoch's

    def done(self, model, optimizer, checkpointer, mixed_precision):
        train_loader, val_loader = self.train_loader, self.val_loader
        samples = len(train_loader.sampler) * dist.get_world_size() * len(self.train_times)
        samples_per_s = samples / sum(self.train_times)
        rank0_print(f"Training: {samples_per_s:.1f} samples/s")
        self.training_done(model, optimizer)
        state, best = checkpointer.state, checkpointer.state["best_checkpoint"]
        self.write(
            train_loss=state["train_losses"][-1], train_losses=state["train_losses"],
            val_loss=state["best_val_loss"], val_losses=state["val_losses"],
            epoch_times=self.epoch_times, samples_per_s=samples_per_s,
            train_batches=len(train_loader), val_batches=len(val_loader or ()),
            peak_memory_after_loading_per_rank=self.loaded,
            checkpoint=f"{best}-hf" if best else None,
            checkpoint_pt=f"{best}.pt" if best and checkpointer.full_state_dict else None,
            adapter=f"{best}-adapter" if best and state["lora"] else None, lora=state["lora"],
            mixed_precision=mixed_precision, fsdp_version=self.args.fsdp_version,
            rouge=self.generated[-1] if self.generated else None, rouge_per_epoch=self.generated,
            best_rouge=state.get("best_rouge"), compiled_graphs_per_epoch=self.graphs,
            sharding_strategy=(model.sharding_strategy.name if isinstance(model, FSDP)
                               else self.args.sharding_strategy))

    def bar(self, loader, desc, colour, leave, disable):
        """train's and validation's bar: tqdm's (live, coloured, cleared at the end) on a
        terminal, as in the tutorial; one line per loop when stderr is a file or a pipe (a log).
        Its batches come through LockStep: ranks that get out of step stop in one line."""
        what = desc.removeprefix("r0 ")
        PROGRESS["at"] = f" in {what}"  # for the line of an interrupted run
        batches = self.lock_step.batches(loader, what.lower())
        if sys.stderr.isatty():
            return tqdm(batches, desc=desc, colour=colour, leave=leave, disable=disable,
                        total=len(loader))
        return FinalLine(batches, desc=desc, disable=disable, total=len(loader))


class FinalLine(tqdm):
    """A tqdm bar for a file or a pipe: no redraws (carriage returns) and no colour codes; it
    writes one line, the bar's final state, when its loop ends."""

    class Discard:
        def write(self, text):
            pass

        def flush(self):
            pass

    def __init__(self, iterable, desc, disable, total):
        super().__init__(iterable, desc=desc, disable=disable, total=total, file=self.Discard())

    def close(self):
        if not self.disable:
            print(self, file=sys.stderr, flush=True)
        super().close()


def resume_target(resume, save_dir):
    """The complete checkpoint --resume names, or None: DIR itself if it holds its trainer state
    (HF Trainer's resume_from_checkpoint), else the newest complete checkpoint-epoch-N in DIR
    (auto: in --save-dir)."""
    folder = save_dir if resume == "auto" else resume
    if os.path.isfile(os.path.join(folder, TRAINER_STATE)):
        return folder
    return newest_complete(folder, "checkpoint-epoch-", TRAINER_STATE)


def find_resumable(resume, save_dir):
    """The complete sharded checkpoint to resume from (resume_target), as rank 0 finds it, on
    every rank; None to start afresh."""
    box = [resume_target(resume, save_dir) if resume and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if resume == "auto" and not box[0]:
        rank0_print(f"No complete checkpoint in --save-dir {os.path.abspath(save_dir)}: starting "
                    "from epoch 1")
    return os.path.abspath(box[0]) if box[0] else None


def check_before_training(args):
    """--save-dir is checked, and made, only once the inputs are: bad input leaves nothing behind.
    With sharded checkpoints, rank 0 locks --save-dir for this job; --overwrite (which
    resume_problem asked for) deletes an earlier run's checkpoints."""
    check_outputs(args, {"--save-dir": os.path.abspath(args.save_dir) if args.save_model
                         else None})
    if not (args.save_model and args.checkpoint_type == "sharded"):
        return
    lock_folder("--save-dir", args.save_dir)
    remove_unfinished_exports(args.save_dir)
    old = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint-epoch-*")))
    if args.resume or not old:
        return
    dist.barrier()  # everyone has seen them before rank 0 deletes them
    if dist.get_rank() == 0:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        rank0_print(f"--overwrite: deleted {len(old)} checkpoint(s) of an earlier run")


def remove_unfinished_exports(save_dir):
    """An attempt killed while exporting left its unfinished folder (or .pt) under its own start
    time's name, which no later export replaces: the folder is this job's now (its lock), so rank
    0 removes them and says so; one that cannot be removed stops the run in one line."""
    error, unfinished = None, []
    if dist.get_rank() == 0:
        unfinished = sorted(glob.glob(os.path.join(glob.escape(save_dir), "T5-model-*.tmp")))
        for path in unfinished:
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError as e:
                error = (f"cannot remove {path}, an unfinished export of an interrupted run "
                         f"({e.strerror or e}); remove it, or pass another --save-dir")
                break
    agree_on_error(error)
    if unfinished:
        rank0_print(f"Removed {len(unfinished)} unfinished export(s) of an interrupted run: "
                    + ", ".join(os.path.basename(path) for path in unfinished))


# ==================================================================================================
# Planner: --plan predicts each rank's memory from the model's config.json alone (the model is
# built on the meta device: no weights read), and exits. Not part of the lesson; tests/test_t5.py
# holds it against measured runs (the training state of every strategy, exactly).
# ==================================================================================================
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


def exit_if_plan(args):
    """args, unless --plan: then print the plan (rank 0), write it to --metrics-json, exit 0."""
    if not args.plan:
        return args
    world_size, local_world_size, device_gib = plan_sizes(args)
    name = os.path.expanduser(args.model_name)
    check_fsdp2_flags(args)
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        fail(f"--plan: {name} holds no config.json; pass a directory written by save_pretrained "
             "or a hub id such as t5-base")
    try:
        config = AutoConfig.from_pretrained(name)
    except Exception as e:
        fail(f"--plan: cannot read the config of --model-name {name} ({reason_line(e)}); pass a "
             "save_pretrained directory, or a hub id on a machine with network")
    quiet_known_warnings()
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = T5ForConditionalGeneration(config)
        if lora := check_lora_flags(args):  # the same adapters, on the meta device
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
               plan, args.metrics_json, script=os.path.basename(__file__))


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
    gib = 2**30
    scale, unit = (gib, "GiB") if plan["peak_bytes"] >= gib else (2**20, "MiB")  # for display
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
    lines += [f"  {name:<48}{value / scale:10.2f}" for name, value in rows]
    lines.append(f"  {'fits one device of (GiB)':<48}{device_gib:10.2f}  "
                 + ("yes" if plan["fits"] else "NO"))
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


# ==================================================================================================
# Running it: main on every rank, however the job was started (safe_launch.py, which all four
# scripts share, holds the launching, the process group and the one-line errors).
# ==================================================================================================
def run(argv=None):
    """Parse the flags and run main on every rank, however the job was started; under torchrun
    --max-restarts with --resume auto, each restart resumes from the newest checkpoint."""
    launch(parse_args(argv), Script(main=main, check_flags=check_flags, resume_hint=resume_hint,
                                    memory_advice=MEMORY_ADVICE))


if __name__ == "__main__":
    run()
