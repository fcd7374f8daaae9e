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
every world size. main applies the safeguards (the safeguards package, copied with this file):
checks before, a `with` around each save. DCP's checkpoint writer processes import this file:
keep its `if __name__ == "__main__":`.
"""
import contextlib
import datetime
import functools
import json
import math
import os
import shutil
import sys
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

from safeguards.checkpoints import check_outputs
from safeguards.describe import describe_fsdp2
from safeguards.errors import LockStep, agree_on_error
from safeguards.flags import RankZeroArgumentParser, add_plan_flags, add_run_flags, positive
from safeguards.fsdp2_checks import DIVERGED, MEMORY_ADVICE, flag_problem, sharding_problem
from safeguards.fsdp2_plan import PLAN_HELP, plan_and_exit
from safeguards.fsdp2_saves import FiniteStager, SafeSaves, resume_hint
from safeguards.launch import launch
from safeguards.replica_groups import TORCHFT, ReplicaGroups, launch_replica_groups
from safeguards.report import Report
from safeguards.step_log import StepLog
from safeguards.workarounds import quiet_known_warnings


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

    background = ""  # the saved line's word on where it was written

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
        """Rank 0 writes the COMPLETE marker once the files are on the disk (fsync: a power cut
        never leaves a marker without its data), then renames the folder (replacing an older
        run's), and syncs the rename."""
        if dist.get_rank() == 0:
            for name in sorted(os.listdir(f"{path}.tmp")):  # DCP has synced its own: cheap
                sync_to_disk(os.path.join(f"{path}.tmp", name))
            with open(os.path.join(f"{path}.tmp", MARKER), "w") as f:
                json.dump({"step": step, "format": self.format, "model": self.config}, f)
            sync_to_disk(os.path.join(f"{path}.tmp", MARKER))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(f"{path}.tmp", path)
            sync_to_disk(self.folder)
            rank0_print(f"Saved checkpoint {path}{self.background}")

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

    background = " (in the background)"

    def __init__(self, folder, config, stager=None):
        """stager: what copies the shards to host memory (None: default_stager())."""
        super().__init__(folder, config, checkpoint_format="sharded")
        self.group = dist.new_group(backend="gloo")  # DCP's writer processes form theirs from it
        self.marking = ThreadPoolExecutor(max_workers=1)
        self.stager = stager or default_stager()
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


def default_stager():
    """DCP's stager of the shards: into shared host memory (the writer process reads it in place),
    pinned on a GPU (copies at full speed), in a thread of its own, kept for the next save."""
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                        use_async_staging=True, use_non_blocking_copy=cuda))


def sync_to_disk(path):
    """fsync a file, or a folder (its entries: a rename in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)


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
    """Load model.pt and optimizer.pt into the sharded model and optimizer: every rank reads them
    once, memory-mapped (only the pages it touches are read), and keeps its own shards. The DTensor
    API slices them locally (distribute_tensor with src_data_rank=None: no communication); DCP's
    state-dict API does the same from the full state dicts."""
    model_state, optim_state = (torch.load(os.path.join(path, name), mmap=True, weights_only=True)
                                for name in ("model.pt", "optimizer.pt"))
    if dcp_api:
        options = StateDictOptions(full_state_dict=True)
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
    agree_on_error(flag_problem(args, device, world_size))  # flags that cannot work: one line
    check_outputs(args.metrics_json, {"--checkpoint-dir": args.checkpoint_dir})  # writable
    quiet_known_warnings()  # library warnings that say nothing a user can act on
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
    agree_on_error(sharding_problem(model, args.mixed_precision))  # stop if it is not as expected
    describe_fsdp2(model, model.layers)

    # 3. The optimizer, after sharding: it holds the DTensor shards. Fused on CUDA (one kernel for
    #    all tensors); foreach on CPU, where torch would otherwise loop over them one by one.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda, foreach=not cuda)
    if args.float8 == "tensorwise":
        float8_scales_after_step(model, optimizer)

    # 4. Resume from the newest complete checkpoint of --checkpoint-dir, if any. Its safeguards
    #    (SafeSaves) check and lock the folder and check each save and the resume, around them.
    checkpointer, saves, start_step = None, None, 0
    if args.async_checkpoint:  # a diverged model is never copied: FiniteStager checks it
        checkpointer = AsyncCheckpointer(args.checkpoint_dir, config,
                                         stager=FiniteStager(default_stager()))
    elif args.checkpoint_dir:
        checkpointer = Checkpointer(args.checkpoint_dir, config,
                                    checkpoint_format=args.checkpoint_format, dcp_api=args.dcp_api)
    if checkpointer:
        saves = SafeSaves(checkpointer, model, optimizer, marker=MARKER, fresh=args.no_resume,
                          overwrite=args.overwrite, advice=DIVERGED)
        path = saves.resumable()  # (the newest complete one, or none)
        if path:
            with saves.reading(path):
                start_step = checkpointer.load(model, optimizer, path)
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
    log = StepLog(Report(args.metrics_json, device), model, steps=steps, log_every=args.log_every,
                  tokens_per_step=args.batch_size * args.seq_len, bf16=args.mixed_precision,
                  warmup=1 + args.compile, advice=DIVERGED)
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
            with saves.saving(step):  # free space, never a diverged model, one-line errors
                checkpointer.save(model, optimizer, step)
            log.paused()
    if checkpointer:
        with saves.finishing():
            checkpointer.wait()  # for an asynchronous save still in flight
    log.done(model, optimizer, saves)  # the summary, memory and --metrics-json


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
    add("--no-resume", action="store_true", help="start at step 0 in a --checkpoint-dir that holds "
        "no checkpoint (or with --overwrite)")
    add("--overwrite", action="store_true", help="with --no-resume, delete the checkpoints "
        "already in --checkpoint-dir")
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
    add = add_run_flags(parser)  # --cpu, --world-size, --dist-timeout, --metrics-json
    add("--log-every", type=positive(int), default=10, metavar="N", help="print every N steps")
    add_plan_flags(parser, PLAN_HELP)  # --plan: will it fit? (safeguards.fsdp2_plan)
    return parser.parse_args(argv)


if __name__ == "__main__":
    # main on every rank: the commands of the docstring, srun, or a Ray Train worker (README.md,
    # 'On a cluster'). --plan: each rank's memory, predicted from the model on the meta device, no
    # training; --fault-tolerance started with python: a Lighthouse and every replica group.
    args = parse_args()
    if args.plan:
        plan_and_exit(args, Transformer, tensor_parallel_plan())
    if args.fault_tolerance and not {"RANK", "SLURM_STEP_NUM_TASKS"} & set(os.environ):
        launch_replica_groups(
            __file__, sys.argv[1:], groups=args.replica_groups, world_size=args.world_size,
            cpu=args.cpu, min_replicas=args.min_replicas, restarts=args.group_restarts,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms, grace_s=args.dist_timeout,
            steps=args.steps, checkpoint_dir=args.checkpoint_dir, metrics_json=args.metrics_json)
    launch(main, args, resume_hint=resume_hint(args.checkpoint_dir, MARKER),
           memory_advice=MEMORY_ADVICE, check=flag_problem)
