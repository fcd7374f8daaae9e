"""FSDP2 (fully_shard) training of a small causal Transformer, on GPUs or on CPU.

The recipe of the PyTorch FSDP2 guide - build on the meta device, fully_shard each block and then
the root, to_empty + reset_parameters, optimizer after sharding - with the guide's options and
torchtitan's (sharded and asynchronous DCP checkpoints, HSDP, tensor parallel, activation
checkpointing, compile).
Read shard_model() (the FSDP2 part), tensor_parallel_plan() (--tp-degree: 2-D parallelism with
FSDP2), train_step(), Checkpointer and AsyncCheckpointer (the checkpoint calls) and main() (the
recipe, in numbered steps). The data: a synthetic next-token task, from a DataLoader.
Each of these runs when copied alone with the imports below (and rank0_print, just after them).

    python fsdp2_transformer.py                      # one process per GPU, or 2 CPU processes
    torchrun --nproc_per_node 8 fsdp2_transformer.py --explicit-prefetching --mixed-precision
    torchrun --nproc_per_node 8 --max-restarts 3 fsdp2_transformer.py --checkpoint-dir ckpt \\
        --checkpoint-format sharded --async-checkpoint
    sbatch --nodes 2 --gpus-per-node 8 slurm.sbatch fsdp2_transformer.py --tp-degree 4  # 4 x 4

CUDA + NCCL when a GPU is visible, else CPU + gloo; --batch-size is the global batch, the same at
every world size. Below the lesson: Safeguards, which main applies around it, then the planner.
Copy it with safe_launch.py (launching, one-line errors: what the four scripts share).
"""
import contextlib
import datetime
import functools
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader


def rank0_print(*args, **kwargs):
    """print on rank 0 only: the one helper of the lesson's pieces."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


# ----------------------------------------------------------------------------------------- model
@torch.no_grad()
def init_(param, fill):
    """Initialize param (a plain tensor or an FSDP2 DTensor shard) with fill(full tensor). On CUDA,
    DTensor's random ops fill each rank's shard with its part of the full tensor's numbers (no rank
    holds a full tensor); not on a CPU mesh, so there every rank draws the full tensor and keeps
    its shard: the same model at any world size."""
    if param.device.type == "cuda":
        fill(param)
        return
    full = fill(torch.empty(param.shape, dtype=param.dtype))
    if isinstance(param, DTensor):  # keep this rank's shard; src_data_rank=None: no communication
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param, full = param.to_local(), full.to_local()
    param.copy_(full)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        # No bias: a key bias cannot change softmax attention; Adam would update it from noise.
        # Three linears, not one: tensor parallel splits each by heads (a fused one, by q/k/v).
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        batch, seq, _ = x.shape  # -1: this rank's heads (all of them without tensor parallel)
        q, k, v = (linear(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for linear in (self.q, self.k, self.v))
        # (A dense mask; flex_attention, compiled, would skip the masked blocks: future work.)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask=None):
        # mask as a keyword: tensor parallel's PrepareModuleInput gathers the positional x only
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size, dim, n_layers, n_heads, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size)
        self.activation_checkpointing = False  # see shard_model()
        self.reset_parameters()  # a no-op on the meta device; after to_empty, call it again

    def forward(self, tokens, positions=None, documents=None):
        if positions is None:  # [1, seq]: the same in every row (packed: restart per document)
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        mask = None if documents is None else (  # [batch, 1, seq, seq]: same document and causal
            documents[:, :, None] == documents[:, None, :]).tril()[:, None]
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            if self.activation_checkpointing:  # keep only x; recompute the block in backward
                x = checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        return self.output(self.norm(x))

    def reset_parameters(self):
        """Initialize every parameter, the blocks' included: all submodules, in model order."""
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                init_(module.weight, lambda t: nn.init.normal_(t, std=0.02))
            elif isinstance(module, nn.LayerNorm):
                init_(module.weight, nn.init.ones_)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                init_(module.bias, nn.init.zeros_)


# ------------------------------------------------------------------------------------------ data
def task_rules(vocab_size, seed, count=4):
    """The synthetic task's count hidden permutations of the vocabulary, fixed by the seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab_size, generator=generator) for _ in range(count)])


def global_batch(rules, step, batch_size, seq_len, seed):
    """The whole batch of `step`, a function of (seed, step) only: each row follows one hidden
    rule from a random start token, x[t+1] = rule[x[t]]. After the first token, a model that works
    out the rule from the previous pair (attention) predicts exactly; a bigram stays at ln 4."""
    generator = torch.Generator().manual_seed((seed * 2**32 + step) % 2**63)
    rule = rules[torch.randint(len(rules), (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(rules.shape[1], (batch_size,), generator=generator)
    for t in range(seq_len):
        tokens[:, t + 1] = rule.gather(1, tokens[:, t:t + 1]).squeeze(1)
    return tokens


def packed_batch(rules, step, batch_size, seq_len, seed, one_per_row=False):
    """Step's global batch as documents (--pack-documents): [batch_size, 4, seq_len], rows of
    (tokens, labels, positions, document ids). Lengths: log-normal (median seq_len / 8, sigma 1: a
    long tail) clipped to [2, seq_len]; each document follows a rule, as global_batch's rows do,
    and one that does not fit starts the next row (one_per_row: each does, the padded baseline)."""
    generator = torch.Generator().manual_seed((seed * 2**32 + step) % 2**63)
    lengths = torch.empty(batch_size * seq_len // 2).log_normal_(  # enough to fill every row
        math.log(seq_len / 8), 1.0, generator=generator).long().clamp(2, seq_len)
    rows = torch.zeros(batch_size, 4, seq_len, dtype=torch.long)
    rows[:, 1], rows[:, 3], row, at = -100, -1, 0, 0  # the padding's labels and document id
    for i, length in enumerate(lengths.tolist()):
        if at + length > seq_len or (one_per_row and at > 0):
            row, at = row + 1, 0
        if row == batch_size:
            break
        rows[row, 2, at:at + length] = torch.arange(length)  # positions restart
        rows[row, 3, at:at + length], at = i, at + length
    tokens, positions, documents = rows[:, 0], rows[:, 2], rows[:, 3]
    # Each document's rule and first token (the padding, document -1, gets tokens too)
    rule, start = (torch.randint(n, (i + 1,), generator=generator) for n in rules.shape)
    for t, doc in enumerate(documents.T):
        tokens[:, t] = torch.where(positions[:, t] == 0, start[doc],
                                   rules[rule[doc], tokens[:, t - 1]])
    # Labels: the next token where it goes on the same document, else -100 (ignored)
    rows[:, 1, :-1] = tokens[:, 1:].where(positions[:, 1:] == positions[:, :-1] + 1, -100)
    return rows


def rank_batch(rules, batch_size, seq_len, seed, rank, world_size, step, task=global_batch):
    """This rank's rows of step's global batch: what the DataLoader's worker builds (see main)."""
    rows = batch_size // world_size
    tokens = task(rules, step, batch_size, seq_len, seed)[rank * rows:(rank + 1) * rows]
    return tokens.clone()  # only these rows travel from the worker


# ------------------------------------------------------------------------------- tensor parallel
def tensor_parallel_plan():
    """parallelize_module's plan for Transformer (Megatron-LM's, with sequence parallel). In each
    block q, k, v and the MLP's first linear are split by output (colwise: a rank computes
    n_heads / T heads, 4 x dim / T hidden units), proj and the MLP's second linear by input
    (rowwise: their outputs are summed and scattered along the sequence); the norms and the
    residual stream hold seq_len / T positions per rank (sequence parallel), all-gathered before
    attention and the MLP. The embeddings are split by rows, the output head by vocabulary,
    whose sharded logits loss_parallel turns into the loss (no rank holds all of them)."""
    whole_sequence = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "layers.*.attention_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
            "layers.*.attention": whole_sequence, "layers.*.mlp": whole_sequence,
            **{f"layers.*.attention.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            "layers.*.attention.proj": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.mlp.0": ColwiseParallel(), "norm": SequenceParallel(),
            "layers.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}


# ---------------------------------------------------------------------------------------- float8
def convert_to_float8(model, recipe):
    """torchao's float8 training (--float8): each block's Linear layers multiply in float8 with
    scales computed from each step's values; the output layer stays in bf16 (the logits). Call it
    on the meta-device model, before torch.compile and shard_model. tensorwise: a scale per tensor,
    and FSDP2 all-gathers the weights in float8 (half of bf16's bytes), their scales computed
    after each optimizer step in one all-reduce (float8_scales_after_step); rowwise: a scale per
    row, closer to bf16, all-gathered in bf16."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, name: name != "output")


def float8_scales_after_step(model, optimizer):
    """tensorwise float8 all-gather: after each optimizer step, every float8 weight's scale for the
    next all-gather, in one all-reduce (not one per weight, in forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(
        lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


# ----------------------------------------------------------------------------------------- FSDP2
def shard_model(model, device, mesh, *, tp_plan=None, mp_policy=MixedPrecisionPolicy(),
                offload_policy=OffloadPolicy(), reshard_after_forward=True, prefetch=0):
    """Shard a model built on the meta device: with tp_plan, tensor parallel over the mesh's "tp"
    dimension first; then fully_shard each block and the root over the other dimensions (one:
    FSDP; "replicate" and "shard": HSDP). Then materialize this rank's shards (to_empty) and
    initialize them (reset_parameters). mp_policy, offload_policy: fully_shard's. prefetch > 0:
    explicit prefetching of that many blocks, not the implicit one block ahead."""
    if tp_plan:
        parallelize_module(model, mesh["tp"], tp_plan)
        mesh = mesh[tuple(name for name in mesh.mesh_dim_names if name != "tp")]
    fsdp_kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=mp_policy, offload_policy=offload_policy)
    for layer in model.layers:  # each block: one all-gather in forward, one reduce-scatter after
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)  # the root: embeddings, final norm and output
    model.to_empty(device="cpu" if isinstance(offload_policy, CPUOffloadPolicy) else device)
    model.reset_parameters()
    blocks = list(model.layers)
    for i, block in enumerate(blocks if prefetch else []):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    return model


# ------------------------------------------------------------------------------------------ step
def train_step(model, optimizer, tokens, grad_accum_steps=1, max_norm=1.0):
    """One optimizer step on this rank's rows of the global batch (or of packed_batch's). Returns
    the loss summed over ranks and the gradient norm as device tensors: reading them (.item())
    would make the host wait for the GPU, so the caller reads them once the next step is queued."""
    optimizer.zero_grad()
    micro_batches = tokens.chunk(grad_accum_steps)
    loss_sum = torch.zeros((), device=tokens.device)
    packed = tokens.dim() == 3
    if packed:  # the step's real tokens (labels not -100), on all ranks: the loss's denominator
        real = (tokens[:, 1] != -100).sum()
        dist.all_reduce(real)  # (tensor parallel: each of the T ranks of a row counts it)
    for i, micro in enumerate(micro_batches):
        # Reduce-scatter after the last micro-batch only; until then gradients add up unsharded.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        inputs, labels, positions, documents = (
            micro.unbind(1) if packed else (micro[:, :-1], micro[:, 1:], None, None))
        logits = model(inputs, positions, documents)
        # Scaled so that the accumulated gradient is that of the mean over all micro-batches;
        # FSDP2 then averages over the ranks: the gradient of the global batch's mean loss.
        # Packed: the sum over real tokens x world size / real, which FSDP2's average over the
        # world size / T data-parallel ranks makes the mean over the step's real tokens.
        # Tensor parallel: the logits are a DTensor split over the vocabulary; loss_parallel
        # computes the loss and its gradient from the parts (no rank gathers all the logits).
        with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                   reduction="sum" if packed else "mean")  # ignores -100
            loss = loss * (dist.get_world_size() / real) if packed else loss / len(micro_batches)
            loss.backward()
        loss = loss.detach()  # as a DTensor, replicated: each rank of a TP group holds it
        loss_sum += loss.to_local() if isinstance(loss, DTensor) else loss
    # The norm of DTensor gradients is the norm of the whole (unsharded) gradient; inf: no clip.
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    optimizer.step()
    dist.all_reduce(loss_sum)  # under NCCL queued on the GPU: the host goes on
    return loss_sum, grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


# ------------------------------------------------------------------------------- fault tolerance
def fault_tolerant(model, optimizer, device, replica_group, store, timeout_s):
    """torchft (--fault-tolerance): this replica group's Manager joins the live groups' quorum at
    every step (the Lighthouse at $TORCHFT_LIGHTHOUSE), averages each gradient shard across them
    after FSDP2's reduce-scatter (HSDP's all-reduce, over the groups alive), commits a step where
    every all-reduce succeeded, and sends a group that (re)joins a live one's state and step.
    Returns it and torchft's optimizer, whose step() steps only a committed step."""
    import torchft  # only with --fault-tolerance: an optional requirement

    timeout = datetime.timedelta(seconds=timeout_s)  # (NCCL's: aborts a collective with the dead)
    manager = torchft.Manager(
        pg=(torchft.ProcessGroupNCCL(timeout) if device.type == "cuda"
            else torchft.ProcessGroupGloo(timeout)),
        # What a live group sends to one that heals (its shards), and how that one loads it:
        state_dict=lambda: sharded_state(model, optimizer),
        load_state_dict=lambda state: set_sharded_state(model, optimizer, state),
        min_replica_size=1, replica_id=f"group_{replica_group}", store_addr=store[0],
        store_port=store[1], timeout=timeout,
        quorum_timeout=2 * timeout,  # (the others may be waiting out a timeout)
        init_sync=False,  # every group initializes the model from the same seed
        # The quorum and a heal before the step: FSDP2 swaps parameters in forward and backward,
        # which a state dict read from torchft's thread meanwhile would meet half done.
        use_async_quorum=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda grad: manager.allreduce(grad).wait())
    return manager, torchft.Optimizer(manager, optimizer)


def manager_steps(manager, last):
    """The steps of a fault-tolerant loop, by the manager's count of committed steps, up to last:
    a step that does not commit runs again; a group that heals goes on at the live groups' step."""
    while manager.current_step() < last:
        yield manager.current_step() + 1


# ------------------------------------------------------------------------------------ checkpoint
MARKER = "COMPLETE"  # written last into a checkpoint's folder: the checkpoint is complete


class Checkpointer:
    """Saves model and optimizer state into <folder>/step_000050 and loads one back, at any world
    size and mesh. Each is written into step_000050.tmp, marked complete by a COMPLETE file
    written last (with the step, the format and the model's config), then renamed: a save cut
    short leaves a .tmp folder, which main's resume (the newest complete one) ignores. full:
    rank 0 gathers the whole state (DTensor API, or DCP's state-dict API with dcp_api) and writes
    model.pt (a plain state dict of Transformer) and optimizer.pt. sharded: every rank writes its
    shards with dcp.save."""

    def __init__(self, folder, config, checkpoint_format="full", dcp_api=False):
        self.folder, self.config = folder, config
        self.format, self.dcp_api = checkpoint_format, dcp_api

    def save(self, model, optimizer, step):
        path = self.new_folder(step)
        if self.format == "sharded":
            dcp.save(sharded_state(model, optimizer), checkpoint_id=f"{path}.tmp")
        else:
            model_state, optim_state = gather_full_state(model, optimizer, self.dcp_api)
            if dist.get_rank() == 0:
                torch.save(model_state, os.path.join(f"{path}.tmp", "model.pt"))
                torch.save(optim_state, os.path.join(f"{path}.tmp", "optimizer.pt"))
        self.mark_complete(step, path)

    def new_folder(self, step):
        """Rank 0 makes the step's .tmp folder (a crash's leftover removed); returns its path."""
        path = os.path.join(self.folder, f"step_{step:06d}")
        if dist.get_rank() == 0:
            shutil.rmtree(f"{path}.tmp", ignore_errors=True)
            os.makedirs(f"{path}.tmp")
        dist.barrier()
        return path

    def mark_complete(self, step, path):
        """Rank 0 writes the COMPLETE marker, then renames the folder (replacing an older run's)."""
        if dist.get_rank() == 0:
            with open(os.path.join(f"{path}.tmp", MARKER), "w") as f:
                json.dump({"step": step, "format": self.format, "model": self.config}, f)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(f"{path}.tmp", path)
            self.saved(path)

    def saved(self, path):
        rank0_print(f"Saved checkpoint {path}")

    def wait(self):
        """Nothing to wait for: a synchronous save is complete when save() returns."""

    def load(self, model, optimizer, path):
        """Resume from the checkpoint at path (a step_000050 folder); return its step."""
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
        if marker["format"] == "sharded":  # every rank reads the parts of its own shards
            state = sharded_state(model, optimizer)
            dcp.load(state, checkpoint_id=path)  # reshards across world sizes and meshes
            set_sharded_state(model, optimizer, state)
        else:
            load_full_state(model, optimizer, path, self.dcp_api)
        rank0_print(f"Resumed from {path} at step {marker['step']}")
        return marker["step"]


class AsyncCheckpointer(Checkpointer):
    """A Checkpointer whose sharded saves return at once: the next optimizer.step() waits for the
    copy of the shards to host memory, then a writer process per rank (started by the first save;
    it imports your script: keep its `if __name__ == "__main__":`) writes them while training
    goes on; a thread marks the checkpoint complete once every rank's are written."""

    def __init__(self, folder, config):
        super().__init__(folder, config, checkpoint_format="sharded")
        self.group = dist.new_group(backend="gloo")  # DCP's writer processes form theirs from it
        self.marking = ThreadPoolExecutor(max_workers=1)
        cuda = torch.cuda.is_available()  # pinned: copies from the GPU at full speed
        self.stager = DefaultStager(StagingOptions(  # shared: the writer reads it in place
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
            use_non_blocking_copy=cuda))
        self.pending, self.staging, self.hook = None, None, None  # the write, the copy, the wait
        self.ahead = None  # stage_ahead's copy

    def stage_ahead(self, model, optimizer):
        """The host memory of the saves' copies, allocated beside training, not in the first save's
        pause (a GPU's pinned memory: seconds per GB): after the next optimizer step (AdamW's state
        exists then), a copy of the state in the stager's thread, thrown away; the stager keeps its
        memory, tensor by tensor, and every save copies into it."""
        def after_step(*_):
            hook.remove()
            self.ahead = self.stager.stage(sharded_state(model, optimizer))

        hook = optimizer.register_step_post_hook(after_step)

    def save(self, model, optimizer, step):
        self.wait()  # one save at a time
        self.wait_ahead()  # this save copies into the memory of stage_ahead's copy
        path = self.new_folder(step)
        # Returns at once; later saves reuse the first one's plan (the same shards every time).
        response = dcp.async_save(sharded_state(model, optimizer), checkpoint_id=f"{path}.tmp",
                                  process_group=self.group, async_stager=self.stager,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
        self.staging = response.staging_completion
        if self.hook is None:  # the copy must end before the optimizer changes the parameters
            self.hook = optimizer.register_step_pre_hook(self.wait_for_staging)
        # Marked once written (rank 0, DCP's coordinator, learns when every rank's shards are).
        self.pending = self.marking.submit(self.mark_when_written, step, path,
                                           response.upload_completion)

    def mark_when_written(self, step, path, written):
        written.result()  # raises the write's error
        self.mark_complete(step, path)

    def wait_for_staging(self, *_):
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.result()

    def wait_ahead(self):
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.result()

    def wait(self):
        """Wait for the last save's copy, background write and marking; raises their error."""
        self.wait_for_staging()
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def sharded_state(model, optimizer):
    """This rank's shards of the model and optimizer state (DTensors), for dcp.save and dcp.load."""
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer)}


def set_sharded_state(model, optimizer, state):
    """Load shards like sharded_state's (read by dcp.load, or received) into model and optimizer."""
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def gather_full_state(model, optimizer, dcp_api):
    """The full model and optimizer state on rank 0's CPU (the other ranks get empty dicts);
    every rank takes part in gathering it. The same result with either API."""
    if dcp_api:  # DCP state-dict API
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    keep = dist.get_rank() == 0

    def full(value):  # DTensor API: every rank takes part in each all-gather; rank 0 keeps it
        value = value.full_tensor() if isinstance(value, DTensor) else value
        return value.cpu() if keep else None

    names = [name for name, _ in model.named_parameters()]  # the optimizer numbers them
    optim_state = optimizer.state_dict()  # its state per parameter: step, exp_avg, exp_avg_sq
    full_state = ({name: full(value) for name, value in model.state_dict().items()}, {
        "state": {names[i]: {k: full(v) for k, v in entries.items()}
                  for i, entries in optim_state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in optim_state["param_groups"]]})
    return full_state if keep else ({}, {})


def load_full_state(model, optimizer, path, dcp_api):
    """Load model.pt and optimizer.pt into the sharded model and optimizer, read memory-mapped (not
    copied into memory). DCP's state-dict API: rank 0 reads them and broadcasts them. DTensor API:
    every rank reads them and keeps its own shards (distribute_tensor with src_data_rank=None
    slices locally, without communication)."""
    model_state, optim_state = {}, {}  # the other ranks' under the DCP API: rank 0's come to them
    if dist.get_rank() == 0 or not dcp_api:
        model_state, optim_state = (
            torch.load(os.path.join(path, name), mmap=True, weights_only=True)
            for name in ("model.pt", "optimizer.pt"))
    if dcp_api:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
        return

    def shard(full, like):
        return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)

    params = dict(model.named_parameters())
    model.load_state_dict({name: shard(model_state[name], p) for name, p in params.items()})
    names = list(params)  # the optimizer numbers the parameters, which the file names
    optimizer.load_state_dict({
        "state": {names.index(name): {k: v if v.dim() == 0 else shard(v, params[name])
                                      for k, v in entries.items()}
                  for name, entries in optim_state["state"].items()},
        "param_groups": [{**group, "params": [names.index(n) for n in group["params"]]}
                         for group in optim_state["param_groups"]]})


# ------------------------------------------------------------------------------------------ main
def main(args, device):
    world_size, rank, cuda = dist.get_world_size(), dist.get_rank(), device.type == "cuda"
    check_checkpoint_dir(args)  # writable, locked, and --no-resume / --overwrite
    torch.manual_seed(args.seed)  # the model's initialization; the data has its own generator

    # 1. The device mesh: FSDP shards over "dp"; HSDP (--replicate-degree R) replicates over
    #    "replicate" and shards over "shard"; tensor parallel (--tp-degree T) splits each layer over
    #    "tp", innermost: T neighbouring ranks, on one node, which read the same rows (rank // T).
    tp, replicas, dp = args.tp_degree, args.replicate_degree, world_size // args.tp_degree
    dims = {"replicate": replicas, "shard": dp // replicas} if replicas > 1 else {"dp": dp}
    if tp > 1:
        dims["tp"] = tp
    mesh = init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))

    # 2. The model: built on the meta device (no memory), with activation checkpointing and
    #    torch.compile per block (in place, as torchtitan does: the names stay), then sharded,
    #    materialized and initialized.
    config = dict(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers,
                  n_heads=args.n_heads, seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(**config)
    model.activation_checkpointing = args.activation_checkpointing
    if args.float8:  # before compile: it compiles the float8 layers' casts with them
        model = convert_to_float8(model, args.float8)
    for layer in model.layers if args.compile else []:
        layer.compile(fullgraph=True)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(model, device, mesh,
                        tp_plan=tensor_parallel_plan() if tp > 1 else None,
                        mp_policy=bf16 if args.mixed_precision else MixedPrecisionPolicy(),
                        offload_policy=CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy(),
                        reshard_after_forward=not args.no_reshard_after_forward,
                        prefetch=args.prefetch_depth if args.explicit_prefetching else 0)
    agree_on_error(check_sharding(model, args.mixed_precision))  # stop if it is not as expected
    describe_fsdp(model)

    # 3. The optimizer, after sharding: it holds the DTensor shards. Fused on CUDA (one kernel for
    #    all tensors); foreach on CPU, where torch would otherwise loop over them one by one.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda, foreach=not cuda)
    if args.float8 == "tensorwise":
        float8_scales_after_step(model, optimizer)

    # 4. Resume from the newest complete checkpoint of --checkpoint-dir, if any: the lesson's
    #    Checkpointer, with the safeguards' checks around each save and load.
    checkpointer, start_step = None, 0
    if args.async_checkpoint:
        checkpointer = CheckedAsyncCheckpointer(args.checkpoint_dir, config)
    elif args.checkpoint_dir:
        checkpointer = CheckedCheckpointer(args.checkpoint_dir, config,
                                           checkpoint_format=args.checkpoint_format,
                                           dcp_api=args.dcp_api)
    if checkpointer and not args.no_resume:
        start_step = checkpointer.load(model, optimizer)  # (the newest complete one, or none)
    if args.async_checkpoint:
        checkpointer.stage_ahead(model, optimizer)  # the saves' host memory, beside the first step

    # 5. Fault tolerance (--fault-tolerance): a replica group of a torchft job; train_step steps
    #    torchft's optimizer, which steps this one where the step commits.
    manager, step_optimizer = None, optimizer
    if args.fault_tolerance:
        groups = ReplicaGroups(args.replica_groups, args.replica_group, args.dist_timeout)
        manager, step_optimizer = fault_tolerant(
            model, optimizer, device=device, replica_group=args.replica_group,
            store=groups.store(), timeout_s=args.dist_timeout)
        manager.load_state_dict({"step": start_step, "batches_committed": 0})
        step_optimizer = groups.started(step_optimizer)  # all in the first quorum, one-line errors

    # 6. The data: on a GPU a worker process builds the next batches, in pinned memory, while a
    #    step runs (the copy, non_blocking, too); on CPU the step needs the cores: built here.
    #    Fault tolerant: the manager says which step is next, so each batch is built when due;
    #    replica group g reads the rows of HSDP's replica g.
    steps = range(start_step + 1, args.steps + 1)
    task = (functools.partial(packed_batch, one_per_row=args.pad_documents)
            if args.pack_documents else global_batch)  # documents packed into rows, or not
    row_rank, row_ranks = ((args.replica_group * dp + rank // tp, args.replica_groups * dp)
                           if manager else (rank // tp, dp))
    make_batch = functools.partial(rank_batch, task_rules(args.vocab_size, args.seed),
                                   args.batch_size, args.seq_len, args.seed, row_rank, row_ranks,
                                   task=task)
    batches = zip(steps, DataLoader(steps, batch_size=None, collate_fn=make_batch,
                                    num_workers=int(cuda), pin_memory=cuda))
    if manager:
        batches = ((step, make_batch(step)) for step in manager_steps(manager, args.steps))

    # 7. Train; every --save-every steps and at the last, save.
    log = StepLog(Report(args, device), model, steps=steps, log_every=args.log_every,
                  tokens_per_step=args.batch_size * args.seq_len, bf16=args.mixed_precision,
                  warmup=1 + args.compile)
    in_step = LockStep(args.dist_timeout)  # ranks out of step fail in one line, not hang
    for step, tokens in in_step.batches(batches, "training", first=steps.start):
        if args.explicit_prefetching:
            model.unshard()  # start the root's all-gather before the step needs it
        loss, grad_norm = train_step(model, step_optimizer, tokens.to(device, non_blocking=True),
                                     grad_accum_steps=args.grad_accum_steps,
                                     max_norm=args.max_norm)
        if manager and manager.current_step() < step:
            continue  # not committed (a group failed during it): the step runs again
        if manager:
            groups.step(step, manager)  # fewer groups than the job's, a heal: one line each
            step = manager.current_step()  # (where this group healed: the live groups' step)
        save_now = checkpointer is not None and (step % args.save_every == 0
                                                 or step == args.steps)
        log.step(step, loss, grad_norm, tokens, check_now=save_now)  # reads the previous step's
        if save_now:
            checkpointer.save(model, optimizer, step)
            log.paused()
    if checkpointer:
        checkpointer.wait()  # for an asynchronous save still in flight
    log.done(model, optimizer, checkpointer)  # the summary, memory and --metrics-json


def parse_args(argv=None):
    parser = RankZeroArgumentParser(
        description="FSDP2 (fully_shard) training of a small causal Transformer")
    add = parser.add_argument_group("model and training").add_argument
    add("--vocab-size", type=positive(int), default=128, metavar="N", help="vocabulary size")
    add("--dim", type=positive(int), default=64, metavar="N", help="model width")
    add("--n-layers", type=positive(int), default=2, metavar="N", help="Transformer blocks")
    add("--n-heads", type=positive(int), default=4, metavar="N", help="heads (must divide --dim)")
    add("--seq-len", type=positive(int), default=32, metavar="N", help="tokens per sequence")
    add("--batch-size", type=positive(int), default=32, metavar="N", help="global batch")
    add("--steps", type=positive(int), default=200, metavar="N", help="optimizer steps to train to")
    add("--lr", type=positive(float, most=1e30), default=3e-3, metavar="LR",
        help="AdamW learning rate, at most 1e30 (much larger ones overflow float32)")
    add("--max-norm", type=positive(float, zero=True), default=1.0, metavar="X",
        help="clip gradients (0: do not)")
    add("--grad-accum-steps", type=positive(int), default=1, metavar="K",
        help="split each rank's batch into K micro-batches; gradients are reduced after the last")
    add("--seed", type=positive(int, zero=True, most=2**32 - 1), default=0, metavar="S",
        help="random seed (model init and the data)")
    add("--pack-documents", action="store_true", help="documents of log-normal lengths (median "
        "--seq-len / 8, sigma 1, clipped to 2..--seq-len) packed into rows: attention and "
        "positions per document, the loss over real tokens; reports useful (non-padding) tokens/s")
    add("--pad-documents", action="store_true", help="the padded baseline: a document per row")
    add = parser.add_argument_group("FSDP2 (torchtitan's flag in brackets)").add_argument
    add("--explicit-prefetching", action="store_true", help="each block all-gathers the next "
        "--prefetch-depth ones in forward and backward; each step starts the root's all-gather")
    add("--prefetch-depth", type=positive(int), default=2, metavar="N", help="blocks to prefetch")
    add("--mixed-precision", action="store_true", help="compute in bfloat16, reduce gradients in "
        "float32 (the sharded parameters and optimizer state stay float32)")
    add("--no-reshard-after-forward", action="store_true",
        help="keep parameters gathered from forward to backward (FSDP1's SHARD_GRAD_OP, ZeRO-2)")
    add("--cpu-offload", action="store_true", help="shards and optimizer step on the host (GPU)")
    add("--replicate-degree", type=positive(int), default=1, metavar="R", help="HSDP: R replicas, "
        "each sharded over world size / (R x T) ranks "
        "(--parallelism.data_parallel_replicate_degree)")
    add("--tp-degree", type=positive(int), default=1, metavar="T", help="tensor parallel: each "
        "layer split over T ranks of a node, the batch over world size / T "
        "(--parallelism.tensor_parallel_degree)")
    add("--activation-checkpointing", action="store_true", help="recompute each block's "
        "activations in backward (activation checkpointing mode full)")
    add("--compile", action="store_true", help="torch.compile each block before sharding it "
        "(--compile.enable)")
    add("--float8", choices=["tensorwise", "rowwise"], metavar="SCALING", help="the blocks' "
        "matmuls in float8 (torchao; NVIDIA GPUs of compute capability 8.9+, with "
        "--mixed-precision): tensorwise (a scale per tensor, weights all-gathered in float8: the "
        "fastest) or rowwise (a scale per row: closer to bf16); fastest with --compile, which "
        "fuses the casts (--model.converters float8)")
    add = parser.add_argument_group("checkpoints").add_argument
    add("--checkpoint-dir", metavar="DIR", help="save to DIR/step_N, resume from the newest there")
    add("--save-every", type=positive(int), default=50, metavar="N", help="save every N steps "
        "and at the last")
    add("--checkpoint-format", default="full", choices=["full", "sharded"], help="full: rank 0 "
        "writes plain model.pt/optimizer.pt; sharded: every rank writes its own shards with DCP "
        "(--checkpoint.enable); both resume at any world size")
    add("--dcp-api", action="store_true", help="full checkpoints with the DCP state-dict API, "
        "not DTensor's full_tensor/distribute_tensor (the same files either way)")
    add("--async-checkpoint", action="store_true", help="sharded checkpoints written in the "
        "background by a writer process per rank (dcp.async_save, --checkpoint.async_mode async), "
        "from a copy to shared host memory made while the next step runs")
    add_fresh_start_flags(add)  # --no-resume, --overwrite (safeguards of --checkpoint-dir)
    add_fault_tolerance_flags(parser)  # --fault-tolerance, --replica-group(s), ... (torchft)
    add = add_run_flags(parser)  # --cpu, --world-size, --dist-timeout, --metrics-json (safe_launch)
    add("--log-every", type=positive(int), default=10, metavar="N", help="print every N steps")
    add_plan_flags(parser, PLAN_HELP)  # --plan: will it fit? (the planner, below the safeguards)
    return exit_if_plan(parser.parse_args(argv))  # --plan prints the memory plan and exits


# ==================================================================================================
# Safeguards: this script's own checks and translations, not part of the lesson; main applies them
# around the lesson's calls. The flag checks; CheckedCheckpointer, the lesson's Checkpointer with
# free-space checks, a folder lock, markers checked against the model, one-line errors and the
# waiting notices; the step log and its figures (tokens/s, TFLOP/s, MFU); labelled workarounds.
# ==================================================================================================
# The imports of the safeguards and of the plumbing (the lesson's own are at the top).
import fnmatch
import glob
import http.server
import importlib.util
import logging
import multiprocessing.connection
import multiprocessing.resource_tracker
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future

from torch.distributed.checkpoint.staging import AsyncStager

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
    launch,
    lock_folder,
    newest_complete,
    plan_sizes,
    positive,
    print_plan,
    root_cause,
    saving,
    stop_if_diverged,
    write_problem,
)

# What the plumbing's one-line errors advise when memory runs out, or when training diverges.
DIVERGED = "try a smaller --lr, or clip the gradients with --max-norm"
MEMORY_ADVICE = ("use a smaller --batch-size (or more --grad-accum-steps), --seq-len, --dim, "
                 "--n-layers or --vocab-size, or --activation-checkpointing")
ELSEWHERE = "pass another --checkpoint-dir"  # where else a save can go, when a disk is full

# Workaround: FSDP2 (torch 2.14, 2.15) warns about every root output that is a view, as the logits
# of F.linear with a bias on a 3-D input are, because an in-place op on it would skip FSDP's
# backward hook. The step only reads the logits (cross_entropy). Remove when FSDP2 stops warning.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")

# Workaround: the checkpoint writer process of DCP (AsyncCheckpointerType.PROCESS, torch 2.11 to
# 2.15) logs to stderr, through the root logger it configures, a line for every request it waits
# for, receives and completes, and a failed write's traceback of every rank: each rank's, at every
# save. It sends a failure to the training process too, which says it in one line. The writer is a
# spawned process, which imports this file first: this filter reaches it. Remove when DCP logs
# these at DEBUG.
logging.getLogger().addFilter(
    lambda record: not record.pathname.endswith("checkpoint/_async_process_executor.py"))


# Workaround: DTensor (torch 2.11 to 2.15) logs a warning on every rank, once, where it runs two
# collectives over two mesh dimensions instead of one: the gradient norm's all-reduce over "dp"
# (or "shard") and "tp" in every step's clip_grad_norm_, and at a full checkpoint the all-gathers
# of a parameter that FSDP2 shards along the dim tensor parallel splits too (_StridedShard: "tp"
# first, then "dp"). Both are exact and the same on every rank (the same collectives, in the same
# order); the second one costs a collective of a scalar, or of one tensor per full save. Remove
# when DTensor merges them or logs this below WARNING.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential" not in record.getMessage())

# Workaround: DCP's checkpoint writer process (torch 2.11 to 2.15) unpickles the DTensors of a
# 2-D mesh, whose process groups only the training processes have, and logs for every mesh of
# every tensor "It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were
# created" (a concern of torch.compile's lookups, which a writer never makes; it needs the shards
# and their offsets only). The writer imports this file first: the filter reaches it. Remove
# when DeviceMesh stops logging this at WARNING.
logging.getLogger("torch.distributed.device_mesh").addFilter(
    lambda record: "pickling/unpickling of the DeviceMesh" not in record.getMessage())


def exit_with_parent():
    """Workaround: a checkpoint writer (DCP's spawned process, torch 2.11 to 2.15) whose training
    process was killed while the writer waited for a peer (forming its process group: up to 30
    minutes) outlives its job. A spawned process imports this file first, as __mp_main__: there a
    thread ends it once its parent is gone. (PR_SET_PDEATHSIG cannot: DCP starts the writer from a
    thread that ends after the first save.) Remove when DCP's writer watches its parent."""
    def watch():
        while multiprocessing.parent_process() is None:  # known once the process has started
            time.sleep(0.1)
        while multiprocessing.parent_process().is_alive():  # (a pipe: dead if closed, at once)
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__mp_main__":
    exit_with_parent()


def check_flags(args, device, world_size):
    """Stop with one line when the flags cannot work together here: every check in one place,
    called by the plumbing before the process group starts."""
    if args.cpu_offload and device.type != "cuda":
        fail("--cpu-offload keeps the sharded parameters in host memory and copies them to the "
             "GPU for each use; it needs a CUDA GPU and none is in use here (drop --cpu-offload, "
             "or run on a GPU without --cpu).")
    if args.cpu_offload and args.tp_degree > 1:
        fail("--cpu-offload with --tp-degree: FSDP2's CPU offload under tensor parallel is not "
             "tested in this script (its GPU tests use one GPU); drop --cpu-offload (tensor "
             "parallel divides each rank's state by T too), or --tp-degree.")
    problem = check_sizes(args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    problem = problem or check_fault_tolerance(args, world_size)
    if problem:
        fail(problem)
    if args.pad_documents and not args.pack_documents:
        fail("--pad-documents puts one document of --pack-documents' task in each row; add "
             "--pack-documents")
    if args.pack_documents and args.seq_len < 2:
        fail(f"--pack-documents with --seq-len {args.seq_len}: a document needs 2 tokens to have "
             "a next one to learn; use --seq-len 2 or more")
    if args.async_checkpoint and args.checkpoint_format != "sharded":
        fail("--async-checkpoint writes sharded checkpoints in the background; add "
             "--checkpoint-format sharded")
    unused = [flag for flag, given in (("--dcp-api", args.dcp_api), ("--overwrite", args.overwrite),
                                       ("--checkpoint-format sharded",
                                        args.checkpoint_format == "sharded"))
              if given and not args.checkpoint_dir]
    if unused:
        fail(f"{unused[0]} says how to save checkpoints, but without --checkpoint-dir none is "
             "saved; add --checkpoint-dir DIR, or drop it")
    if args.mixed_precision and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        fail("--mixed-precision computes in bfloat16, which this GPU does not support; drop it.")
    if args.float8:
        problem = check_float8(args, device, world_size)
        if problem:
            fail(problem)
    if args.compile:  # fail now, in one line, rather than at the first step
        check_compile(device)


def check_sizes(args, world_size, ranks_per_node):
    """Why these sizes and degrees cannot train at this world size, or None (check_flags, and
    --plan). ranks_per_node: the processes of one node (torchrun's --nproc_per_node)."""
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


def check_float8(args, device, world_size):
    """Why --float8 cannot train here, or None (check_flags)."""
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


def describe_fsdp(model):
    """Print the FSDP units fully_shard built and their prefetch plan, compiled and checkpointed
    blocks. torch 2.14 has no public getter for the plan: this reads FSDP2's private state."""
    compiled = sum(layer._compiled_call_impl is not None for layer in model.layers)  # private
    rank0_print(f"Blocks compiled: {compiled} of {len(model.layers)}; activation checkpointing: "
                f"{'every block' if model.activation_checkpointing else 'none'}")
    units = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    names = {module._get_fsdp_state(): name for name, module in units}
    for name, module in units:
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        size = sum(p.sharded_param.numel() for p in group.fsdp_params)
        reshard = group.post_forward_mesh_info is not None and module is not model  # root: never
        forward = [names[s] for s in state._states_to_forward_prefetch]
        backward = [names[s] for s in state._states_to_backward_prefetch]
        rank0_print(f"  FSDP unit {name}: {size:,} parameters, reshard after forward {reshard}, "
                    f"explicit prefetch: forward {forward}, backward {backward}")


def check_sharding(model, mixed_precision):
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


def check_checkpoint_dir(args):
    """--checkpoint-dir (and --metrics-json) must be writable; lock the folder for this job.
    --no-resume starts from step 0 in a folder that must then hold no checkpoint: an older run's
    later checkpoints would be resumed instead of this run's. --overwrite deletes them first (the
    Hugging Face convention: refuse a non-empty folder unless told to)."""
    check_outputs(args, {"--checkpoint-dir": args.checkpoint_dir})
    folder = args.checkpoint_dir
    if not folder:
        return
    lock_folder("--checkpoint-dir", folder)
    old = sorted(glob.glob(os.path.join(folder, "step_*")))
    if not args.no_resume or not old:
        return
    if not args.overwrite:
        fail(f"--checkpoint-dir {folder} holds checkpoints of an earlier run "
             f"({os.path.basename(old[-1])}...), which a later resume would mix with this run's; "
             "drop --no-resume to continue it, add --overwrite to delete them, or pass another "
             "--checkpoint-dir")
    dist.barrier()  # everyone has seen them before rank 0 deletes them
    if dist.get_rank() == 0:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        rank0_print(f"--overwrite: deleted {len(old)} checkpoint(s) of an earlier run")


def add_fresh_start_flags(add):
    add("--no-resume", action="store_true", help="start at step 0 in a --checkpoint-dir that holds "
        "no checkpoint (or with --overwrite)")
    add("--overwrite", action="store_true", help="with --no-resume, delete the checkpoints "
        "already in --checkpoint-dir")


# ----------------------------------------------------------------------- fault tolerance (torchft)
TORCHFT = "torchft==0.2.0"  # the version tests/test_fault_tolerance.py passes with


def add_fault_tolerance_flags(parser):
    add = parser.add_argument_group("fault tolerance (torchft: an optional requirement, "
                                    f"pip install {TORCHFT})").add_argument
    add("--fault-tolerance", action="store_true", help="replica groups that fail and come back "
        "while the others train on (torchft, --fault_tolerance.enable): each group is its own job, "
        "sharding over its ranks; the groups average gradients like HSDP's replicas. Started with "
        "python: a Lighthouse and --replica-groups torchrun jobs of --world-size ranks each; "
        "under torchrun or srun: one group, with --replica-group and $TORCHFT_LIGHTHOUSE")
    add("--replica-groups", type=positive(int), default=2, metavar="G", help="groups in the job: "
        "group g reads the rows of HSDP's replica g (--fault_tolerance.group_size)")
    add("--replica-group", type=positive(int, zero=True), metavar="I", help="this group, 0 to "
        "G - 1, under torchrun or srun (--fault_tolerance.replica_id); every group needs the "
        "same number of ranks: one heals from a live one's shards, rank by rank")
    add("--min-replicas", type=positive(int), default=1, metavar="N", help="started with python: "
        "the Lighthouse's quorum needs N live groups (1: train on while any lives)")
    add("--group-restarts", type=positive(int, zero=True), default=3, metavar="N", help="started "
        "with python: torchrun restarts a failed group up to N times (--max-restarts)")
    add("--heartbeat-timeout-ms", type=positive(int), default=1000, metavar="MS", help="started "
        "with python: the Lighthouse drops a group that sent no heartbeat for MS (its default "
        "5000)")


def import_torchft():
    """torchft, quiet (quiet_torchft), or one line saying how to install it."""
    os.environ.setdefault("RUST_LOG", "warn")  # before its import: its servers' INFO lines
    try:
        import torchft
        import torchft.coordination
    except ImportError as e:
        fail(f"--fault-tolerance needs torchft ({e}): pip install {TORCHFT}")
    quiet_torchft()
    return torchft


def quiet_torchft():
    """Workarounds for what torchft 0.2.0 prints in a run that goes well; remove each when a run
    of tests/test_fault_tolerance.py prints it no more without it.
    - Its Lighthouse and managers (Rust) log a line per quorum, request and commit at INFO:
      RUST_LOG=warn (import_torchft, before the import; a user's RUST_LOG is kept).
    - Each reconfiguration of its process groups calls _set_sequence_number_for_group, which
      torch 2.14 made a no-op that warns "setSequenceNumberForGroup() is deprecated" each time.
    - The HTTP server that sends a healing group its state logs each request to stderr.
    - The group that heals reads the shards from a read-only buffer: torch warns once "The given
      buffer is not writable" (it copies them into the model: nothing writes to that buffer).
    And one that breaks healing: its HTTP transport fetches a live group's state with urllib,
    which goes through $http_proxy where one is set (clusters often do): the proxy refuses, or
    stores, a transfer between the job's own hosts. This script makes no other HTTP request: no
    proxy for any."""
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = "*"
    for backend in (getattr(dist, name, None) for name in ("ProcessGroupGloo", "ProcessGroupNCCL")):
        if backend is not None:
            backend._set_sequence_number_for_group = lambda self: None
    http.server.BaseHTTPRequestHandler.log_message = lambda self, *args: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def check_fault_tolerance(args, world_size):
    """Why these flags cannot run fault tolerant here, or None (check_flags)."""
    if not args.fault_tolerance:
        if args.replica_group is not None:
            return "--replica-group names a replica group of --fault-tolerance; add it"
        return None
    import_torchft()
    for flag, given in (("--replicate-degree", args.replicate_degree > 1),
                        ("--tp-degree", args.tp_degree > 1),
                        ("--pack-documents", args.pack_documents)):
        if given:
            return (f"{flag} with --fault-tolerance is not supported here (each replica group "
                    "shards over its ranks with FSDP2 only, rows of equal weight); drop one")
    if args.replica_group is None:
        return ("--fault-tolerance under torchrun or srun runs one replica group: say which with "
                f"--replica-group 0 to {args.replica_groups - 1} (started with python, it starts "
                "them all)")
    if args.replica_group >= args.replica_groups:
        return (f"--replica-group {args.replica_group} is not one of --replica-groups "
                f"{args.replica_groups} (0 to {args.replica_groups - 1})")
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        return ("--fault-tolerance under torchrun or srun joins a Lighthouse: start one "
                "(torchft_lighthouse --min_replicas 1) and set "
                "TORCHFT_LIGHTHOUSE=http://HOST:29510")
    if args.batch_size % (args.replica_groups * world_size):
        return (f"--batch-size {args.batch_size} does not split into --replica-groups "
                f"{args.replica_groups} x {world_size} ranks; use a multiple of "
                f"{args.replica_groups * world_size}")
    return None


class ReplicaGroups:
    """--fault-tolerance's safeguards around the lesson's fault_tolerant(), for this replica group
    (group of groups): a store of its own, a first quorum that holds every group, a lost
    Lighthouse in one line, and a line where steps train on fewer groups or this group healed."""

    def __init__(self, groups, group, timeout_s):
        self.groups, self.group, self.timeout_s = groups, group, timeout_s
        self.short_since = None  # the first step trained on fewer groups, while it lasts
        logging.getLogger("torchft.manager").addFilter(OneLinePerEvent(group))
        # torchft's ProcessGroupNCCL warns where this is unset, and sets it to its own timeout
        # (the lesson's: --dist-timeout); in whole seconds; a user's value is kept.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(math.ceil(timeout_s)))

    def store(self):
        """The (host, port) of a TCPStore for this group's torchft Manager, served by its rank 0
        for this attempt. Workaround: the Manager (torchft 0.2.0) publishes its server's address
        under a fixed key of the store it is given; torchrun's store outlives a --max-restarts
        restart, so the other ranks of a restarted group could read the dead server's address.
        Remove when the Manager takes a store prefix."""
        where = [None, None]
        if dist.get_rank() == 0:
            GROUP_STORE.append(dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False))
            where = [socket.gethostname(), GROUP_STORE[0].port]
        dist.broadcast_object_list(where)
        return where

    def started(self, optimizer):
        """Started with python, wait until every group's manager is up (launch_replica_groups'
        store), so that the first quorum holds them all: one that joins later heals into the run,
        but the steps before trained on fewer rows. Only rank 0's Manager asks the Lighthouse:
        only it waits. Under torchrun and srun the groups start when the scheduler starts them.
        Returns optimizer (torchft's), whose zero_grad ends in one line where no quorum comes."""
        address = os.environ.get("FT_START_STORE")
        if (address is not None and dist.get_rank() == 0
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            if store.add("groups_started", 1) == self.groups:
                store.set("all_started", "yes")
            try:
                store.wait(["all_started"])
            except dist.DistStoreError:
                fail(f"replica group {self.group}: the other groups did not start within "
                     f"--dist-timeout {self.timeout_s:g}s; see their lines")
        zero_grad = optimizer.zero_grad

        def zero_grad_or_one_line(set_to_none=True):  # where torchft's step asks for a quorum
            try:
                zero_grad(set_to_none)
            except (TimeoutError, RuntimeError) as e:
                reason = " ".join(str(e).split())[:160]
                fail(f"replica group {self.group}: no quorum from the Lighthouse at "
                     f"{os.environ['TORCHFT_LIGHTHOUSE']} within 2 x --dist-timeout "
                     f"{self.timeout_s:g}s ({reason}): it stopped or cannot be reached. Restart "
                     "it and the groups: they resume from their newest checkpoint in "
                     "--checkpoint-dir")

        optimizer.zero_grad = zero_grad_or_one_line
        return optimizer

    def step(self, step, manager):
        """After a committed step: a line where steps begin to train on fewer replica groups than
        the job has (torchft skips the rows of a group not in the quorum: the global batch
        shrinks), where all are back, and where this group healed (received a live one's state)."""
        live, now = manager.num_participants(), manager.current_step()
        if now > step:
            rank0_print(f"step {now}: healed: received the model and optimizer state of step "
                        f"{now - 1} from a live replica group, and trained on")
        if live < self.groups and self.short_since is None:
            self.short_since = now
            rank0_print(f"step {now}: {live} of {self.groups} replica groups train: the rows of "
                        "the others are skipped until they are back (a global batch of "
                        f"{live}/{self.groups} of --batch-size)")
        elif live == self.groups and self.short_since is not None:
            rank0_print(f"step {now}: all {self.groups} replica groups train again (steps "
                        f"{self.short_since}-{now - 1} skipped the rows of those missing)")
            self.short_since = None


GROUP_STORE = []  # rank 0's TCPStore server: alive as long as the process


class OneLinePerEvent(logging.Filter):
    """torchft's failures as one line each, of rank 0 of the group that sees them, without
    torchft's traceback: what failed, in which step, the first line of the reason, and what
    happens now. Workaround: torchft 0.2.0 logs each caught failure with its traceback at ERROR
    (the step is then retried, which is what a user needs to know). Remove when it logs one line."""

    EVENTS = {"waiting for work": "an all-reduce across replica groups failed",
              "in all reduce": "an all-reduce across replica groups failed",
              "in recovery": "receiving a live group's state failed",
              "in pg configure": "joining the replica groups' process group failed"}

    def __init__(self, group):
        super().__init__()
        self.group = group

    def filter(self, record):
        message = record.getMessage()
        event = next((e for key, e in self.EVENTS.items() if key in message), None)
        if event and dist.get_rank() == 0:
            step = re.search(r" - step (\d+)\]", message)
            reason = record.exc_info[1] if record.exc_info else message.split(": ", 1)[-1]
            reason = " ".join(str(reason).split())[:160]
            print(f"replica group {self.group}: step {int(step[1]) + 1 if step else '?'} not "
                  f"committed: {event} ({reason}); it runs again with the groups alive",
                  file=sys.stderr, flush=True)
        return event is None and record.levelno >= logging.WARNING  # its INFO lines: none


def relay(pipe, out, prefix):
    """Each line of a replica group's output, with the group's name in front (launch_replica_groups:
    each group's rank 0 prints the group's lines)."""
    for line in iter(pipe.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def launch_replica_groups(argv, *, groups, world_size, cpu, min_replicas, restarts,
                          heartbeat_timeout_ms, grace_s, steps, checkpoint_dir, metrics_json):
    """--fault-tolerance started with python (argv: its flags): a Lighthouse in this process and a
    torchrun job per replica group of world_size ranks (each GPU in one group), which restarts the
    group up to `restarts` times when one of its ranks fails; group g saves into
    checkpoint_dir/group_g and writes its metrics to metrics_json's name + .group<g>. Ends when
    every group has: the status of the first that failed for good, else 0."""
    torchft = import_torchft()
    gpus = torch.cuda.device_count() if not cpu else 0
    per_group = world_size or max(gpus // groups, 1)
    if gpus and per_group * groups > gpus:
        fail(f"--replica-groups {groups} x --world-size {per_group} asks for more GPUs than the "
             f"{gpus} present")
    lighthouse = torchft.coordination.LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
        heartbeat_timeout_ms=heartbeat_timeout_ms)
    rank0_print(f"Lighthouse at {lighthouse.address()}: {groups} replica groups of {per_group} "
                f"rank(s), each restarting itself up to {restarts} times")
    start = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    jobs, relays = [], []
    for group in range(groups):
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(),
                   FT_START_STORE=f"127.0.0.1:{start.port}")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(group * per_group + i) for i in range(per_group))
        own = ["--replica-group", str(group)]  # (the last of a repeated flag counts)
        if checkpoint_dir:  # each group's own checkpoints and metrics
            own += ["--checkpoint-dir", os.path.join(checkpoint_dir, f"group_{group}")]
        if metrics_json:
            root, ext = os.path.splitext(metrics_json)
            own += ["--metrics-json", f"{root}.group{group}{ext}"]
        jobs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={per_group}", f"--max-restarts={restarts}",
             os.path.abspath(__file__), *argv, *own],
            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for pipe, out in ((jobs[-1].stdout, sys.stdout), (jobs[-1].stderr, sys.stderr)):
            relays.append(threading.Thread(target=relay, args=(pipe, out, f"[group {group}] ")))
            relays[-1].start()

    def pass_on(signum, frame):  # Ctrl-C or a kill of this process: torchrun stops its workers
        for process in jobs:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, pass_on)
    # Done when every group has ended, or one has trained to --steps and the others did not follow
    # within --dist-timeout (their last steps): a group still restarting then would only train the
    # same steps again, alone.
    finished_at = None
    while any(process.poll() is None for process in jobs):
        finished = [g for g, process in enumerate(jobs) if process.poll() == 0]
        if finished and finished_at is None:
            finished_at = time.monotonic()
        late = finished and time.monotonic() - finished_at > grace_s
        for group, process in enumerate(jobs if late else []):
            if process.poll() is None:
                rank0_print(f"replica group {group} stopped: group {finished[0]} has trained to "
                            f"step {steps}")
                os.killpg(process.pid, signal.SIGKILL)  # its torchrun and workers
                process.wait()
        time.sleep(0.2)
    codes = [process.poll() if process.poll() != -signal.SIGKILL else 0 for process in jobs]
    for thread in relays:
        thread.join()
    lighthouse.shutdown()
    sys.exit(next((code for code in codes if code), 0))


# What --metrics-json says of the checkpoints when none is saved: CheckedCheckpointer.figures()
# fills it in (the staging figures: CheckedAsyncCheckpointer's).
NO_CHECKPOINTS = {"checkpoint": None, "checkpoint_stall_s": [], "checkpoint_wait_s": [],
                  "checkpoint_staging_bytes": None, "checkpoint_staging_s": None}


class CheckedCheckpointer(Checkpointer):
    """The lesson's Checkpointer with the safeguards around it. A save refuses non-finite
    parameters and a save the disk cannot hold, stops every rank in one line if a write fails (its
    .tmp folder removed); its files reach the disk before the marker does. A resume reads only a
    checkpoint whose marker and tensors fit this model, and a read that fails stops every rank in
    one line. pauses: the seconds each save blocked training; waits: the part of them spent
    waiting for the previous save's background write (asynchronous)."""
    background = ""  # the saved line's word on where it was written

    def __init__(self, folder, config, **options):
        self.started, self.last, self.path, self.pauses, self.waits = None, None, None, [], []
        self.doing = None  # what a background write was doing, for its error line
        super().__init__(os.path.abspath(folder), config, **options)

    def save(self, model, optimizer, step):
        started = time.perf_counter()
        self.wait()  # (asynchronous) the previous save's line reads its pause: start this after
        self.started = started
        waited = time.perf_counter() - started
        self.waits.append(waited)
        if waited > 0.5:  # an asynchronous save's pause is then the disk's, not the copy's
            rank0_print(f"Waited {waited:.2f} s for the previous checkpoint's background write: "
                        "it takes longer than --save-every steps of training; save less often, "
                        "or to a faster disk")
        self.refuse_diverged(model)
        self.path = os.path.join(self.folder, f"step_{step:06d}")
        self.doing = f"write checkpoint {self.path}"
        with saving(self.path, checkpoint_bytes(model, optimizer, full=self.format == "full"),
                    f"{ELSEWHERE}; {rerun_resumes(self.folder)}",
                    sharded=self.format == "sharded"):
            self.pauses.append(0.0)  # an asynchronous save's line may come before it returns
            with ctrl_c_for_training_only():
                super().save(model, optimizer, step)
        self.pauses[-1] += time.perf_counter() - self.started

    def refuse_diverged(self, model):
        """Never save a diverged model: a parameter that is NaN or infinite stops every rank."""
        stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)

    def saved(self, path):
        """The line of a complete checkpoint, with the time training paused for it so far."""
        rank0_print(f"Saved checkpoint {path}{self.background}, training paused "
                    f"{self.paused_so_far():.2f} s")
        self.last = path

    def paused_so_far(self):
        """A synchronous save is marked complete inside save(), which has paused training since it
        started."""
        return time.perf_counter() - self.started

    def figures(self):
        """What --metrics-json says of the saves: the last complete one, each save's pause and the
        part of it spent waiting for the previous save's background write."""
        return {**NO_CHECKPOINTS, "checkpoint": self.last, "checkpoint_stall_s": self.pauses,
                "checkpoint_wait_s": self.waits}

    def mark_complete(self, step, path):
        """The lesson's, durable across a power cut: the files reach the disk (fsync) before the
        marker says they are complete, then the marker and the rename do."""
        for name in sorted(os.listdir(f"{path}.tmp")) if dist.get_rank() == 0 else ():
            sync_to_disk(os.path.join(f"{path}.tmp", name))  # DCP has synced its own: cheap
        super().mark_complete(step, path)
        if dist.get_rank() == 0:
            sync_to_disk(os.path.join(path, MARKER))
            sync_to_disk(self.folder)  # the rename

    def stop(self, error):
        """Stop every rank (each calls this with the same error) in one line; rank 0 removes the
        failed save's .tmp folder."""
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp", ignore_errors=True)
        fail(f"{error}; {rerun_resumes(self.folder)}")

    def load(self, model, optimizer):
        """The lesson's load of the newest complete checkpoint as rank 0 finds it (newest_complete),
        once its marker (and a full checkpoint's tensors) are found to fit this model; a failed
        read stops every rank in one line. Returns its step (0: none)."""
        found, error = [None], None
        if dist.get_rank() == 0:
            for path in glob.glob(os.path.join(glob.escape(self.folder), "step_*")):
                if folder_number(path, "step_") is not None and not os.path.exists(
                        os.path.join(path, MARKER)):
                    rank0_print(f"Ignoring incomplete checkpoint {path} (no {MARKER} marker)")
            found[0] = newest_complete(self.folder, "step_", MARKER)
            shapes = {name: p.shape for name, p in model.named_parameters()}
            error = checkpoint_problem(found[0], shapes, self.config) if found[0] else None
        agree_on_error(error)
        dist.broadcast_object_list(found, src=0)  # every rank loads the checkpoint rank 0 checked
        self.path, step = found[0], 0
        if self.path is None:
            rank0_print(f"No complete checkpoint in --checkpoint-dir {self.folder}: starting "
                        "from step 0")
            return 0
        try:
            step = super().load(model, optimizer, self.path)
        except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank
            error = (f"cannot read checkpoint {self.path} ({error_summary(root_cause(e))}); delete "
                     "it to resume from the checkpoint before it, or pass --no-resume")
        agree_on_error(error)
        return step


class CheckedAsyncCheckpointer(CheckedCheckpointer, AsyncCheckpointer):
    """The lesson's AsyncCheckpointer with the same safeguards, and: the writer processes started
    before training (start_writers), a save that waits for the previous background write says so
    when that took long, a diverged model is never copied (FiniteStager), and a copy or write that
    fails on any rank stops every rank in one line. pauses: in save, and in the next step's wait
    for the copy to host memory."""
    background = " (in the background)"

    def __init__(self, folder, config):
        super().__init__(folder, config)
        self.stager = FiniteStager(self.stager)  # the divergence check runs with the copy
        self.start_writers()

    def start_writers(self):
        """DCP starts each rank's writer process (a new Python, which imports torch and this
        script) at its first save, and training would wait while it starts: a save of one number
        to a throwaway folder starts them now, before training, the ranks in step while they
        start (wait), SIGINT blocked for the writers; one that fails to start stops every rank in
        one line."""
        # multiprocessing unblocks SIGINT in the thread that starts its resource tracker (Python
        # 3.11's ensure_running), which the writer's start would otherwise do, inside
        # ctrl_c_for_training_only: started here, first.
        multiprocessing.resource_tracker.ensure_running()
        self.path = os.path.join(self.folder, "writers")  # its .tmp is removed if it fails
        self.doing = "start the checkpoint writer processes"
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp", ignore_errors=True)  # the leftover of a crash
        dist.barrier()
        with ctrl_c_for_training_only():
            self.pending = dcp.async_save({"start": torch.zeros(1)},
                                          checkpoint_id=f"{self.path}.tmp",
                                          process_group=self.group,
                                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            self.wait()  # rank 0's save ends last: after every rank's writer wrote its file
        if dist.get_rank() == 0:
            shutil.rmtree(f"{self.path}.tmp")

    def refuse_diverged(self, model):
        """Nothing to do before the save: its FiniteStager checks the parameters with the copy, off
        training's path."""

    def paused_so_far(self):
        """A save is marked complete once written, in a thread: its pause is save()'s and the next
        step's wait for the copy, as recorded so far (that step may still be waiting)."""
        return self.pauses[-1]

    def stage_ahead(self, model, optimizer):
        """The lesson's: the stager's first copy is then stage_ahead's, which it reports."""
        self.stager.ahead = True
        super().stage_ahead(model, optimizer)

    def wait_ahead(self):
        """The lesson's, inside the first save (its pause counts the wait, which is not for a
        previous write); a failed copy stops every rank in one line, as a save's copy does."""
        self.staging, self.ahead = self.ahead, None
        self.wait_for_staging()

    def figures(self):
        """The saves' figures, and each copy's new shared memory (bytes), seconds (its check
        included) and tensors in newly allocated host memory: stage_ahead's apart."""
        stager, ahead = self.stager, int(self.stager.ahead)
        copies = [dict(zip(("bytes", "s", "new_tensors"), copy)) for copy in zip(
            stager.grown, stager.seconds, stager.new_tensors)]
        return {**super().figures(), "checkpoint_staging_bytes": stager.grown[ahead:],
                "checkpoint_staging_s": stager.seconds[ahead:],
                "checkpoint_staging_new_tensors": stager.new_tensors[ahead:],
                "checkpoint_staged_ahead": copies[0] if ahead and copies else None}

    def wait_for_staging(self, *hook_args):
        """The lesson's, and a failed copy stops every rank in one line. Called as the optimizer's
        hook (hook_args), training waited: that counts in the pause of the save; called by wait()
        at the end of training, it does not."""
        started, staging, error = time.perf_counter(), self.staging, None
        try:
            super().wait_for_staging()
        except NonFinite as e:
            error = f"training diverged: {e}; {DIVERGED}"
        except Exception as e:
            error = f"cannot copy checkpoint {self.path} to host memory ({error_summary(e)})"
        if staging is not None:
            errors = [None] * dist.get_world_size()  # a rank's copy may fail alone
            dist.all_gather_object(errors, error)
            if any(errors):
                self.stop(next(error for error in errors if error))
            if hook_args:
                self.pauses[-1] += time.perf_counter() - started

    def wait(self):
        """The lesson's wait, the ranks in step: while a rank's background write is under way,
        they compare every 0.1 s whether one has failed (a writer that died leaves its peers'
        waiting for it for ever). A failed write stops every rank in one line, and rank 0 removes
        its .tmp folder."""
        self.wait_for_staging()  # (every rank: it may take part in a collective)
        while True:
            error, finished = None, self.pending is None or self.pending.done()
            if finished:
                try:
                    super().wait()
                # Workaround: DCP's staging_completion says that a copy which failed before
                # async_save returned succeeded (torch 2.11 to 2.15 do not check a done staging
                # future); the failure then comes with the write. Remove when DCP passes it on.
                except NonFinite as e:
                    error = f"training diverged: {e}; {DIVERGED}"
                except (Exception, dcp.CheckpointException) as e:  # the latter: BaseException
                    error = (write_problem(e, self.path, ELSEWHERE)
                             or f"cannot {self.doing} ({error_summary(root_cause(e))})")
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, (finished, error))
            if all(finished for finished, _ in states) or any(error for _, error in states):
                break
            time.sleep(0.1)
        if any(error for _, error in states):
            self.stop(next(error for _, error in states if error))


def shared_memory_bytes():
    """The bytes of shared memory this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))
    except (OSError, StopIteration):
        return 0


@contextlib.contextmanager
def ctrl_c_for_training_only():
    """The threads started inside (DCP's, for an asynchronous save), and the checkpoint writer
    process they start, have SIGINT blocked: a Ctrl-C reaches the training process, which says
    where a rerun resumes and ends its writer (end_child_processes), never a writer, which would
    print a KeyboardInterrupt traceback of each rank's. (The resource tracker must be running
    already: CheckedAsyncCheckpointer.start_writers starts it.)"""
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def sync_to_disk(path):
    """fsync a file, or a folder (its entries: a rename in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)


def checkpoint_bytes(model, optimizer, full):
    """The bytes of model and optimizer state a save writes on this rank: all of it (full, where
    rank 0 writes), or this rank's shards."""
    tensors = [*model.parameters(), *(value for state in optimizer.state.values()
                                      for value in state.values() if torch.is_tensor(value))]
    return sum(t.numel() * t.element_size() if full or not isinstance(t, DTensor)
               else t.to_local().numel() * t.element_size() for t in tensors)


def checkpoint_problem(path, shapes, config):
    """Why rank 0 cannot resume from the checkpoint at path, or None: its marker must be of its
    folder's step and of this model's sizes; a full checkpoint's files must read, and hold
    tensors of this model's shapes (shapes: {parameter name: shape})."""
    redo = f"delete {path} to resume from the checkpoint before it, or pass --no-resume"
    loaded = []
    for name in (MARKER, "model.pt", "optimizer.pt"):
        if loaded and loaded[0].get("format", "full") == "sharded":
            break  # its shards are read by every rank
        try:
            with open(os.path.join(path, name), "rb") as f:
                loaded.append(json.load(f) if name == MARKER else torch.load(f, weights_only=True))
        except Exception as e:
            return (f"cannot read checkpoint file {os.path.join(path, name)} "
                    f"({' '.join(str(e).split())}); {redo}")
    marker, states = loaded[0], loaded[1:]
    if marker.get("step") != folder_number(path, "step_"):  # edited, or copied as another
        return (f"checkpoint {path}: its {MARKER} marker says step {marker.get('step')!r}, not "
                f"its folder's; {redo}")
    if marker.get("model") != config:
        flags = [" ".join(f"--{k.replace('_', '-')} {v}" for k, v in (sizes or {}).items())
                 for sizes in (marker.get("model"), config)]
        return (f"checkpoint {path} was written for another model ({flags[0]}) than this run's "
                f"({flags[1]}); pass its sizes, another --checkpoint-dir or --no-resume")
    try:
        fits = marker["step"] > 0
        if states:  # a full checkpoint: its tensors must fit the model
            model_state, optim_state = states
            fits = fits and {k: v.shape for k, v in model_state.items()} == shapes
            fits = fits and set(optim_state["state"]) == set(shapes)
            for name, entries in optim_state["state"].items():
                for value in entries.values():
                    fits = fits and value.shape in (torch.Size(), shapes[name])
    except (AttributeError, KeyError, TypeError):
        fits = False
    if not fits:
        return (f"checkpoint {path} does not hold this model's parameters and optimizer state; "
                "pass --no-resume")
    return None


def rerun_resumes(folder):
    """Which checkpoint of folder a rerun resumes from (said when a save fails or the run stops)."""
    newest = newest_complete(folder, "step_", MARKER)
    if newest is None:
        return (f"no complete checkpoint in --checkpoint-dir {folder} yet: a rerun starts from "
                "step 0")
    return (f"the last complete checkpoint is step {folder_number(newest, 'step_')} ({newest}): "
            "run the same command to resume")


def resume_hint(args):
    """Where a rerun of the same command resumes: the plumbing says it when Ctrl-C or SIGTERM
    stops the run."""
    if not args.checkpoint_dir:
        return "no --checkpoint-dir: a rerun starts from step 0"
    return rerun_resumes(os.path.abspath(args.checkpoint_dir))


def error_summary(error):
    """An exception's type and first sentence, on one line."""
    text = " ".join(str(error).split()).split(". ")[0][:200]
    return f"{type(error).__name__}: {text}"


# Workaround: in torch 2.11, DefaultStager frees its host memory after every copy, and a second
# save with it fails (KeyError: <class 'type'>, pytorch/pytorch#183413; fixed by torch 2.13). A
# new stager per save would allocate (and on a GPU pin) all of its memory again, which paused a
# save of a 1B model 3-6 s on an H200: there, FiniteStager copies into host memory of its own,
# made once by DCP's _create_cpu_state_dict. Remove when requirements.txt asks for torch >= 2.13.
STAGER_REUSABLE = torch.__version__ >= (2, 13)


class NonFinite(ValueError):
    """A save's state holds a NaN or infinite parameter."""


class FiniteStager(AsyncStager):
    """The lesson's stager, after a check that no parameter is NaN or infinite: a diverged model
    is never saved. The check reads every parameter (on CPU as long as the copy does), so it runs
    in a thread of its own (on a GPU, on a stream of its own) before the copy, off training's
    path; the next step's wait for the copy learns its outcome (NonFinite)."""
    _synchronize_after_execute = False  # stage() returns a future

    def __init__(self, stager):
        self.stager, self.checking = stager, ThreadPoolExecutor(max_workers=1)
        self.seconds, self.grown = [], []  # each copy's check and copy; its new shared memory
        self.ahead = False  # the first copy is AsyncCheckpointer.stage_ahead's
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.buffers = None  # torch < 2.13: the host memory every copy goes to (STAGER_REUSABLE)
        # Per copy, its tensors not in the first copy's memory (held: no new allocation can get
        # one of its addresses): [all of them, 0, 0, ...] where the memory is reused.
        self.first_copy, self.first_addresses, self.new_tensors = None, set(), []

    def stage(self, state_dict):
        return self.checking.submit(self.check_then_stage, state_dict)

    def check_then_stage(self, state_dict):
        # The parameters stay as they are until the next optimizer step, which waits for this.
        started, shared = time.perf_counter(), shared_memory_bytes()
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            bad = sum((~torch.isfinite(t)).any() for t in tensors_of(state_dict["model"]))
            if bad:
                raise NonFinite("a parameter is not finite (NaN or infinite)")
        if STAGER_REUSABLE:
            staged = self.stager.stage(state_dict)
            staged = staged.result() if isinstance(staged, Future) else staged
        else:
            staged = self.copy_to_buffers(state_dict)
        self.seconds.append(time.perf_counter() - started)
        self.grown.append(shared_memory_bytes() - shared)
        self.count_new_tensors(staged)
        if self.ahead and len(self.seconds) == 1:
            rank0_print(f"Staged ahead: {self.grown[0] / 2**20:,.1f} MiB of shared host memory "
                        + ("(pinned) " if self.stream else "") + "for the checkpoints' copies, "
                        f"allocated and filled in {self.seconds[0]:.2f} s beside training (rank "
                        "0's); every save copies into it")
        return staged

    def copy_to_buffers(self, state_dict):
        """torch < 2.13: the copy that the lesson's stager makes, into host memory allocated at
        the first save and reused by every later one; shared (the writer process reads it in
        place) and, on a GPU, pinned, as the lesson's StagingOptions ask."""
        # (private, and needed before torch 2.13 only: imported here, not where a later torch
        # might have moved them)
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.buffers is None:
            self.buffers = _create_cpu_state_dict(state_dict, pin_memory=self.stream is not None,
                                                  share_memory=True)
            # It leaves 0-dim tensors (AdamW's step counts) unshared: sending the first save to
            # DCP's writer process would move each into new shared memory of its own.
            for tensor in tensors_of(self.buffers):
                tensor.share_memory_()
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            staged = _copy_state_dict(state_dict, self.buffers, non_blocking=bool(self.stream))
        if self.stream:
            self.stream.synchronize()  # the next step may change the parameters
        return staged

    def count_new_tensors(self, staged):
        """How many of this copy's tensors lie outside the first copy's host memory."""
        addresses = {tensor.data_ptr() for tensor in tensors_of(staged)}
        self.new_tensors.append(len(addresses - self.first_addresses))
        if self.first_copy is None:
            self.first_copy, self.first_addresses = staged, addresses

    def close(self):
        self.checking.shutdown()
        self.stager.close()


def tensors_of(state):
    """Every tensor (a DTensor's local shard) in a nested state dict."""
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else []
    for value in values:
        if isinstance(value, (dict, list)):
            yield from tensors_of(value)
        elif torch.is_tensor(value):
            yield value.to_local() if isinstance(value, DTensor) else value


class StepLog:
    """Each step's loss and gradient norm, read from the device one step late, so that the host
    never makes the GPU wait (the loss of the newest step is read only on a line or before a
    save). Every --log-every steps a line gives the loss and, for the steps since the line before,
    tokens/s (on a GPU also TFLOP/s and MFU). A non-finite loss stops every rank. done() prints
    the steady state, the first warmup steps and checkpoint pauses excluded, and the metrics;
    with packed documents also useful tokens/s: the tokens of documents, not of the padding."""

    def __init__(self, report, model, steps, log_every, tokens_per_step, bf16, warmup):
        """steps: the range of steps this run trains."""
        self.report, self.log_every, self.warmup = report, log_every, warmup
        self.first, self.last_step = steps.start, steps.stop - 1
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token(model, model.pos_embeddings.num_embeddings)
        self.peak_tflops = peak_tflops(report.device, bf16)
        self.unread, self.losses, self.grad_norms, self.seconds = [], [], [], []
        self.useful = []  # packed documents: each step's (document tokens, tokens) on this rank
        self.last_line = 0  # len(self.seconds) when the last line was printed
        if not steps:
            rank0_print(f"The checkpoint is at step {self.first - 1}, --steps is "
                        f"{self.last_step}: no training")
        self.clock = time.perf_counter()

    def step(self, step, loss, grad_norm, batch, check_now=False):
        """batch: this rank's rows, on the host (packed_batch's: their padding is counted)."""
        PROGRESS["at"] = f" at step {step}"  # for the line of an interrupted run
        if batch.dim() == 3:  # (tokens, labels, positions, document ids); the padding's is -1
            self.useful.append((int((batch[:, 3] >= 0).sum()), batch[:, 3].numel()))
        self.unread.append((step, loss, grad_norm))
        line = step % self.log_every == 0 or step in (self.first, self.last_step)
        self.read(keep=0 if line or check_now else 1)
        now = time.perf_counter()
        self.seconds.append(now - self.clock)  # since the step before: the data wait included
        self.clock = now
        if line:
            rate = self.tokens_per_s(self.seconds[self.last_line:])
            rank0_print(f"step {step} | loss {self.losses[-1]:.4f} | grad norm "
                        f"{self.grad_norms[-1]:.3f} | tokens/s {rate:,.0f}" + self.flops(rate))
            self.last_line = len(self.seconds)

    def read(self, keep):
        while len(self.unread) > keep:
            step, loss, grad_norm = self.unread.pop(0)
            loss = loss.item() / dist.get_world_size()  # the same on every rank: it is reduced
            if not math.isfinite(loss):
                fail(f"training diverged: the loss of step {step} is {loss}; {DIVERGED}")
            self.losses.append(loss)
            self.grad_norms.append(grad_norm.item())

    def useful_share(self, warmup):
        """Packed documents: the share of the steady steps' tokens (every rank's) that are in a
        document, not padding; else None. Every rank calls it (an all-reduce)."""
        if not self.useful:
            return None
        counts = torch.tensor(self.useful[max(warmup, 0):] or self.useful, dtype=torch.float64)
        counts = counts.sum(dim=0).to(self.report.device)
        dist.all_reduce(counts)  # (tensor parallel: each row counted T times, in both)
        return (counts[0] / counts[1]).item()

    def paused(self):
        """A checkpoint paused training until now: not training time."""
        self.clock = time.perf_counter()

    def tokens_per_s(self, seconds):
        return self.tokens_per_step * len(seconds) / sum(seconds) if seconds else None

    def flops(self, tokens_per_s):
        """TFLOP/s per GPU and MFU (model FLOPs utilization) at tokens_per_s, for a log line."""
        if self.report.device.type != "cuda":
            return ""
        tflops = self.flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
        return f" | {tflops:.1f} TFLOP/s" + (
            f" | MFU {tflops / self.peak_tflops:.1%}" if self.peak_tflops else "")

    def done(self, model, optimizer, checkpointer):
        """The summary of the steady state, memory, and --metrics-json."""
        self.read(keep=0)
        warmup = min(self.warmup, len(self.seconds) - 1)  # at least one step counts
        steady = self.seconds[max(warmup, 0):]
        step_time = statistics.median(steady) if steady else None
        tokens_per_s = self.tokens_per_step / step_time if step_time else None
        per_process = self.flops_per_token * (tokens_per_s or 0) / dist.get_world_size()
        figures = {"flops_per_token": self.flops_per_token, "gflops_per_s": per_process / 1e9,
                   "tflops_per_gpu": None, "mfu": None}
        if self.report.device.type == "cuda":
            figures["tflops_per_gpu"] = per_process / 1e12
            figures["mfu"] = self.peak_tflops and per_process / 1e12 / self.peak_tflops
        useful = self.useful_share(warmup)
        figures["useful_tokens_per_s"] = useful * tokens_per_s if useful and tokens_per_s else None
        if self.losses:
            vocab = model.output.out_features
            rank0_print(f"Trained steps {self.first}-{self.last_step}: final loss "
                        f"{self.losses[-1]:.4f} (ln(vocab) = {math.log(vocab):.4f}"
                        f"), {tokens_per_s:,.0f} tokens/s in the steady state" + (
                            f", {figures['useful_tokens_per_s']:,.0f} of them useful ({useful:.1%} "
                            "in documents, not padding)" if useful else "") + " (median step "
                        f"{step_time * 1000:.1f} ms, the first {max(warmup, 0)} step(s) and "
                        "checkpoint pauses left out), " + (
                            f"{figures['tflops_per_gpu']:.1f} TFLOP/s per GPU" + (
                                f", MFU {figures['mfu']:.1%}" if figures["mfu"] else "")
                            if figures["tflops_per_gpu"] is not None else
                            f"{figures['gflops_per_s']:,.1f} GFLOP/s per process"))
        self.report.training_done(model, optimizer, trained=bool(self.losses))
        saves = checkpointer.figures() if checkpointer else NO_CHECKPOINTS
        pauses = saves["checkpoint_stall_s"]
        if pauses:
            rank0_print(f"Checkpoints paused training {pauses[0]:.2f} s at the first save" + (
                f", a median {statistics.median(pauses[1:]):.2f} s at the {len(pauses) - 1} "
                "later ones" if len(pauses) > 1 else ""))
        self.report.write(
            train_loss=self.losses[-1] if self.losses else None, losses=self.losses,
            grad_norms=self.grad_norms, first_step=self.first,
            step=max(self.first - 1, self.last_step), tokens_per_s=tokens_per_s,
            step_time_s=step_time, warmup_steps=max(warmup, 0), step_times_s=self.seconds,
            **saves, **figures)


# Dense peak TFLOP/s of one GPU in (bf16, fp32), from NVIDIA's data sheets: the first name found
# in torch.cuda.get_device_name() counts. Other GPUs get no MFU.
PEAK_TFLOPS = {"H100 PCIe": (756, 51), "H100": (989, 67), "H200": (989, 67), "A100": (312, 19.5),
               "L40S": (362, 91.6), "L4": (121, 30.3)}


def peak_tflops(device, bf16):
    """This GPU's dense peak TFLOP/s in bf16 (or fp32), or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((p for gpu, p in PEAK_TFLOPS.items() if gpu in name), None)
    return peak and peak[0 if bf16 else 1]


def flops_per_token(model, seq_len):
    """Model FLOPs of one trained token, as torchtitan counts them: 6 per parameter outside the
    embeddings (the matmuls of forward and backward) plus 12 x layers x dim x seq_len for the
    attention scores and values. Recomputation (activation checkpointing) does not count."""
    embeddings = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embeddings  # DTensors: global sizes
    return 6 * params + 12 * len(model.layers) * model.norm.weight.numel() * seq_len


# ==================================================================================================
# Planner: --plan predicts each rank's memory from the model built on the meta device, before
# anything is allocated, and exits. Not part of the lesson; tests/test_fsdp2_scale.py holds it
# against measured runs (the training state exactly, the saved activations); the peaks of a 1B
# model on an H100 were within 6% (benchmarks/README.md).
# ==================================================================================================
NOT_COUNTED = ("not counted: the CUDA context (about 0.5 GiB per GPU), allocator fragmentation, "
               "NCCL buffers, the DataLoader worker")
PLAN_HELP = (f"({NOT_COUNTED}.) Checked against real runs: the training state to the byte; peaks "
             "of a 1B model on an H100 within 6%%")  # --plan's help, after what it does


def exit_if_plan(args):
    """args, unless --plan: then print the plan (rank 0), write it to --metrics-json, exit 0."""
    if not args.plan:
        return args
    world_size, local_world_size, device_gib = plan_sizes(args)
    config = dict(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers,
                  n_heads=args.n_heads, seq_len=args.seq_len)
    options = {"batch_size": args.batch_size, "grad_accum_steps": args.grad_accum_steps,
               "mixed_precision": args.mixed_precision, "cpu_offload": args.cpu_offload,
               "reshard_after_forward": not args.no_reshard_after_forward,
               "prefetch": args.prefetch_depth if args.explicit_prefetching else 1,
               "activation_checkpointing": args.activation_checkpointing, "tp": args.tp_degree}
    problem = check_sizes(args, world_size, local_world_size)
    if problem:
        fail(f"--plan: {problem}")
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = Transformer(**config)
    plan = memory_plan(model, world_size, args.replicate_degree, **options)
    plan["fits"] = plan["peak_bytes"] <= device_gib * 2**30
    print_plan(plan_text(model, plan, world_size, args.replicate_degree, device_gib, options),
               plan, args.metrics_json, script=os.path.basename(__file__))


def tensor_parallel_dims(model):
    """{parameter name: the dim that tensor_parallel_plan() splits it along}, for --plan."""
    dims = {}
    for pattern, style in tensor_parallel_plan().items():
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
                cpu_offload, reshard_after_forward, prefetch, activation_checkpointing, tp=1):
    """Each rank's memory in bytes, from the model's shapes (on the meta device).

    Training state, exact: tensor parallel (tp > 1) splits parameters as tensor_parallel_plan()
    says, then FSDP2 shards each rank's part along dim 0 into world size / (replicate x tp)
    chunks (rank 0's, the largest, is counted): fp32 parameters, gradients and AdamW's two
    moments, and a 4-byte step per tensor. Activations: what autograd saves in one micro-batch's
    forward for backward, counted tensor by tensor for this model (the 17 x tokens x dim of a
    block: the inputs of 2 norms and 4 linears, q, k, v and attention's output, the MLP's two
    4 x dim tensors; norm statistics and attention's log-sum-exp in fp32; under tensor parallel
    all but the gathered inputs of q, k, v and the MLP divided by tp), with activation
    checkpointing only each block's input (and one block again while it is recomputed). The
    peak is at the start of backward: parameters and moments (gradients are freed at each step),
    gathered units, every activation, and the loss's three fp32 tokens x vocab buffers."""
    shard, dp = world_size // replicate // tp, world_size // tp
    compute = 2 if mixed_precision else 4  # bytes per element of the unsharded parameters
    dims = tensor_parallel_dims(model) if tp > 1 else {}
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
    gib = 2**30
    scale, unit = (gib, "GiB") if plan["peak_bytes"] >= gib else (2**20, "MiB")  # for display
    tp = options["tp"]
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
    lines += [f"  {name:<48}{value / scale:10.2f}" for name, value in rows]
    lines.append(f"  {'fits one device of (GiB)':<48}{device_gib:10.2f}  "
                 + ("yes" if plan["fits"] else "NO"))
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


# ==================================================================================================
# Running it: main on every rank, however the job was started (safe_launch.py, which all four
# scripts share, holds the launching, the process group and the one-line errors).
# ==================================================================================================
def run(argv=None):
    """Parse the flags and run main on every rank: the commands of the docstring, srun, or a Ray
    Train worker (README.md, 'On a cluster')."""
    args = parse_args(argv)
    if args.fault_tolerance and not {"RANK", "SLURM_STEP_NUM_TASKS"} & set(os.environ):
        launch_replica_groups(  # started with python: the Lighthouse and every group
            sys.argv[1:] if argv is None else argv, groups=args.replica_groups,
            world_size=args.world_size, cpu=args.cpu, min_replicas=args.min_replicas,
            restarts=args.group_restarts, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            grace_s=args.dist_timeout, steps=args.steps, checkpoint_dir=args.checkpoint_dir,
            metrics_json=args.metrics_json)
    launch(args, Script(main=main, check_flags=check_flags, resume_hint=resume_hint,
                        memory_advice=MEMORY_ADVICE))


if __name__ == "__main__":
    run()
