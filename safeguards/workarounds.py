"""The workarounds of torch, transformers and PEFT behaviours, together, to prune as versions move:
each says what breaks, in which versions, and when to remove it.

Importing this module applies the filters that must reach DCP's checkpoint writer processes,
which import the training script (its imports, then nothing of its main) and run no main."""
import contextlib
import gc
import http.server
import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.fsdp import _init_utils as fsdp_init_utils

from .errors import FAILING, end_child_processes

# Workaround: the checkpoint writer process of DCP (AsyncCheckpointerType.PROCESS, torch 2.11 to
# 2.15) logs to stderr, through the root logger it configures, a line for every request it waits
# for, receives and completes, and a failed write's traceback of every rank: each rank's, at every
# save. It sends a failure to the training process too, which says it in one line. Remove when
# DCP logs these at DEBUG.
logging.getLogger().addFilter(
    lambda record: not record.pathname.endswith("checkpoint/_async_process_executor.py"))

# Workaround: DTensor (torch 2.11 to 2.15) logs a warning on every rank, once, where it runs two
# collectives over two mesh dimensions instead of one: the gradient norm's all-reduce over "dp"
# and "tp" in every step's clip_grad_norm_, and at a full checkpoint the all-gathers of a
# parameter that FSDP2 shards along the dim tensor parallel splits too (_StridedShard). Both are
# exact and the same on every rank. Remove when DTensor merges them or logs this below WARNING.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential" not in record.getMessage())

# Workaround: DCP's checkpoint writer process (torch 2.11 to 2.15) unpickles the DTensors of a
# 2-D mesh, whose process groups only the training processes have, and logs for every mesh of
# every tensor "It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were
# created" (a concern of torch.compile's lookups, which a writer never makes). Remove when
# DeviceMesh stops logging this at WARNING.
logging.getLogger("torch.distributed.device_mesh").addFilter(
    lambda record: "pickling/unpickling of the DeviceMesh" not in record.getMessage())


def exit_with_parent():
    """Workaround: a checkpoint writer (DCP's spawned process, torch 2.11 to 2.15) whose training
    process was killed while the writer waited for a peer (forming its process group: up to 30
    minutes) outlives its job. A spawned process imports the script first, as __mp_main__: there
    a thread ends it once its parent is gone. (PR_SET_PDEATHSIG cannot: DCP starts the writer from
    a thread that ends after the first save.) Remove when DCP's writer watches its parent."""
    def watch():
        while multiprocessing.parent_process() is None:  # known once the process has started
            time.sleep(0.1)
        while multiprocessing.parent_process().is_alive():  # (a pipe: dead if closed, at once)
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if "__mp_main__" in sys.modules:  # a spawned process: a checkpoint writer, or a spawned rank
    exit_with_parent()


def quiet_known_warnings():
    """Silence what says nothing a user can act on; each filter matches one message. Remove a
    filter when its warning no longer shows in the suite's runs (they assert that no warning is
    printed)."""
    # FSDP1 (torch 2.14, 2.15) deprecates NO_SHARD in favour of DistributedDataParallel, with a
    # FutureWarning per unit (ddp_mnist.py is that program; the strategy works, and is what one
    # process falls back to), and warns at each state dict of a NO_SHARD model that it returns a
    # full one (when loaded, spelled "willbe"). Its optimizer state-dict code calls a
    # torch-internal helper that warns about its own deprecation (_get_pg_default_device).
    warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are "
                            r"registered|full_state_dict will ?be returned|The `NO_SHARD` sharding "
                            r"strategy is deprecated)")
    # FSDP2 (torch 2.14, 2.15) warns about every module output that is a view (an in-place op on
    # it would skip FSDP's backward hook): fsdp2_transformer.py's logits (F.linear with a bias on
    # a 3-D input), T5's position bias, which the next blocks reuse. Both are only read, and the
    # losses equal one process's (tests). Remove when FSDP2 stops warning.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")
    # PEFT (0.21) reads transformers' deprecated is_gradient_checkpointing while it adds adapters,
    # which transformers 5 answers with a FutureWarning. Remove when PEFT reads
    # is_activation_checkpointing.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")


def end_cleanly(made_here):
    """Workaround: FSDP and DDP keep the process group alive through reference cycles; freed only
    at exit, gloo's threads can abort a finished run with SIGABRT ("terminate called without an
    active exception"; torch 2.14, 2.15). Free them while Python still can: when main failed, the
    tracebacks on their way out hold its frames, hence the model: clear those first. After an
    error line, end at once, before the interpreter's teardown, where those threads can still
    abort it. Remove when a torch release's destroy_process_group ends gloo's threads."""
    error = sys.exc_info()[1]
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__
    gc.collect()
    if dist.is_initialized() and made_here:
        dist.destroy_process_group()
    if FAILING:  # its error line is out; a bug's traceback goes to torchrun's @record
        sys.stdout.flush()
        sys.stderr.flush()
        end_child_processes()
        os._exit(1)


def offload_to_cpu(model):
    """Whether a full state dict's gather offloads the tensors to the CPU (only rank 0's).

    Workaround: a CPU run's tensors are in host memory already, and offloading them there breaks
    the gather in torch 2.11 ("setStorage: ... storage of size 0"; fine in 2.14): there every rank
    gets them. Remove it (always True) once requirements.txt asks for torch >= 2.14."""
    return next(model.parameters()).device.type != "cpu"


# Workaround: in torch 2.11, DefaultStager frees its host memory after every copy, and a second
# save with it fails (KeyError: <class 'type'>, pytorch/pytorch#183413; fixed by torch 2.13). A
# new stager per save would allocate (and on a GPU pin) all of its memory again, which paused a
# save of a 1B model 3-6 s on an H200: there, FiniteStager copies into host memory of its own,
# made once by copy_into_buffers. Remove when requirements.txt asks for torch >= 2.13.
STAGER_REUSABLE = torch.__version__ >= (2, 13)


def copy_into_buffers(state_dict, buffers, stream):
    """torch < 2.13: the copy DefaultStager makes, into host memory (buffers; None: made now, by
    DCP's _create_cpu_state_dict) reused by every later copy; shared (the writer process reads it
    in place) and, on a GPU (stream), pinned. Returns (buffers, the copy)."""
    # (private, and needed before torch 2.13 only: imported here, not where a later torch might
    # have moved them)
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    from .report import tensors_in

    if buffers is None:
        buffers = _create_cpu_state_dict(state_dict, pin_memory=stream is not None,
                                         share_memory=True)
        # It leaves 0-dim tensors (AdamW's step counts) unshared: sending the first save to
        # DCP's writer process would move each into new shared memory of its own.
        for tensor in tensors_in(buffers):
            tensor.share_memory_()
    with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
        staged = _copy_state_dict(state_dict, buffers, non_blocking=stream is not None)
    if stream:
        stream.synchronize()  # the next step may change the parameters
    return buffers, staged


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
