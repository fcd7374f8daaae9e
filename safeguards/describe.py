"""What FSDP built, printed from the wrapped model itself rather than from the flags: FSDP1's
units and FSDP2's groups, their sizes and settings. No public call gives a unit's sizes (FSDP1's
flat parameter) or a group's prefetch plan (FSDP2's state): these read them privately."""
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .errors import rank0_print


def short(name):
    """A module's name without the wrappers' parts ("" is the root)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name or "root"


def describe_fsdp1(model):
    """FSDP1's units: the strategy and options, then each unit's parameters and rank 0's part;
    parameters FSDP leaves whole (a LoRA run's adapters), and what trains."""
    units = [(name, unit) for name, unit in model.named_modules() if isinstance(unit, FSDP)]
    dtypes = [str(d).replace("torch.", "") for d in vars(model.mixed_precision).values()][:3]
    rank0_print(f"FSDP built {len(units)} unit{'s' * (len(units) != 1)}: "
                f"{model.sharding_strategy.name}, backward prefetch "
                f"{getattr(model.backward_prefetch, 'name', 'NONE')}, CPU offload "
                f"{model.cpu_offload.offload_params}, use_orig_params {model._use_orig_params}, "
                f"limit_all_gathers {model.limit_all_gathers}, mixed precision param {dtypes[0]} "
                f"reduce {dtypes[1]} buffer {dtypes[2]} (None: not cast), activation "
                f"checkpointing of {sum(isinstance(m, CheckpointWrapper) for m in model.modules())}"
                " blocks")
    flats = []
    for name, unit in units:
        flat = unit._flat_param  # private: the unit's own parameters, flattened and sharded
        inner = unit.module.module if isinstance(unit.module, CheckpointWrapper) else unit.module
        total = flat._unpadded_unsharded_size.numel() if flat is not None else 0
        rank0_print(f"  {short(name)} ({type(inner).__name__}): {total:,} parameters, "
                    f"{flat.numel() if flat is not None else 0:,} on rank 0")
        flats += [flat] if flat is not None else []
    whole = list(model._ignored_params)  # private: what FSDP leaves whole (ignored_states)
    if whole:
        rank0_print(f"  {len(whole)} LoRA adapter matrices, {sum(p.numel() for p in whole):,} "
                    "parameters: whole on every rank, gradients averaged in one all-reduce")
    describe_lora([(flat._unpadded_unsharded_size.numel(), flat.requires_grad, flat.dtype)
                   for flat in flats] + [(p.numel(), p.requires_grad, p.dtype) for p in whole])


def describe_fsdp2(model, blocks):
    """fully_shard's groups: the mesh and mixed precision, how many of the blocks (the modules
    compiled in place, if any) are compiled and recompute in backward, then each group's
    parameters, whether it reshards after forward and its explicit prefetch plan; what trains."""
    groups = [(short(name), module) for name, module in model.named_modules()
              if isinstance(module, FSDPModule)]
    names = {module._get_fsdp_state(): name for name, module in groups}
    first = groups[-1][1]._get_fsdp_state()._fsdp_param_group  # a block's: the group settings
    policy = getattr(first.fsdp_params[0], "mp_policy", None) or first.mp_policy  # torch 2.15
    dtypes = [str(d).replace("torch.", "") for d in (policy.param_dtype, policy.reduce_dtype)]
    mesh = tuple(first.fsdp_params[0].sharded_param.device_mesh.shape)
    rank0_print(f"FSDP2 sharded {len(groups)} groups on a {mesh} mesh: mixed precision param "
                f"{dtypes[0]} reduce {dtypes[1]} (None: not cast)")
    compiled = sum(block._compiled_call_impl is not None for block in blocks)  # private
    recomputed = sum(isinstance(m, CheckpointWrapper) for m in model.modules()) or (
        len(blocks) * getattr(model, "activation_checkpointing", False))  # fsdp2_transformer's
    rank0_print(f"Blocks compiled: {compiled} of {len(blocks)} (torch.compile, in place); "
                f"activation checkpointing: {recomputed} of {len(blocks)}")
    for name, module in groups:
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        size = sum(p.sharded_param.numel() for p in group.fsdp_params)
        reshard = group.post_forward_mesh_info is not None and module is not model  # root: never
        forward = [names[s] for s in state._states_to_forward_prefetch]
        backward = [names[s] for s in state._states_to_backward_prefetch]
        rank0_print(f"  FSDP unit {name}: {size:,} parameters, reshard after forward {reshard}, "
                    f"explicit prefetch: forward {forward}, backward {backward}")
    describe_lora([(p.numel(), p.requires_grad, p.dtype) for p in model.parameters()])


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


def compiled_graphs():
    """How many graphs torch.compile has compiled in this process (dynamo's private counters: no
    public call counts them)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def fsdp1_full_bytes(model):
    """The bytes of an FSDP1 model's full state dict: each unit's unsharded size in its
    parameters' dtype."""
    return sum(unit._flat_param._unpadded_unsharded_size.numel() * unit._flat_param.element_size()
               for unit in FSDP.fsdp_modules(model) if unit._flat_param is not None)
