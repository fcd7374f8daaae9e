"""The flags every script has (how it runs, --plan), and argparse's refusals as one line from
rank 0, with each flag's default in --help where it says something."""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist

from .errors import fail, rank0_print


class RankZeroArgumentParser(argparse.ArgumentParser):
    """The flags' parser: a bad value is said once, from rank 0, not once per torchrun worker;
    --help gives each flag's default where it says something (HelpWithDefaults)."""

    def __init__(self, description):
        super().__init__(description=description, formatter_class=HelpWithDefaults)

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:
            super().error(message)
        fail(message)


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """"(default: X)" after a flag's help, but not after a switch (off unless given), a default of
    None (its help says what happens then) or help that names its default itself."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive(kind, zero=False, most=math.inf):
    """An argparse type: a finite number of that kind (int or float), above 0 (with zero: 0 or
    more) and at most `most`; so never NaN."""
    def parse(text):
        value = kind(text)
        if not ((value >= 0 if zero else value > 0) and math.isfinite(value) and value <= most):
            rule = "a positive integer" if kind is int else "a positive number"
            if zero:
                rule = "an integer" if kind is int else "a number"
                rule += " from 0" if most < math.inf else " of 0 or more"
            if most < math.inf:
                shown = f"{most:,}" if kind is int else f"{most:g}"
                rule += f" to {shown}" if zero else f" of at most {shown}"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # for argparse's "invalid int value: 'x'"
    return parse


def add_run_flags(parser):
    """The flags of every script about how it runs; returns their group, for the script's own."""
    add = parser.add_argument_group("run").add_argument
    add("--cpu", "--no-cuda", action="store_true", help="CPU and gloo even if there are GPUs")
    add("--world-size", type=positive(int), metavar="N", help="processes to start without "
        "torchrun (None: one per GPU, or 2 on CPU)")
    add("--dist-timeout", type=positive(float), default=600, metavar="S", help="seconds to wait "
        "for a lost or hung peer before the job fails (longer than any save or download)")
    add("--metrics-json", metavar="PATH", help="write the final metrics to PATH (rank 0)")
    add("--return-freed-memory", action="store_true", help="on CPU, give freed blocks of 256 KiB "
        "or more back to the system at once (glibc keeps them for reuse): at t5-base's shape "
        "with LoRA, about half the memory a rank gains while training, at 1.3x the time")
    return add


def add_plan_flags(parser, details):
    """--plan and --plan-device-memory; details: what the script's planner reads and leaves out."""
    add = parser.add_argument_group("plan: will it fit? (no training)").add_argument
    add("--plan", action="store_true", help="print each rank's predicted memory for these flags "
        "(training state, gathered FSDP units, activations, logits) at --world-size and for "
        "1-64 ranks, whether it fits --plan-device-memory, and the cheapest flags that would "
        f"make it fit; then exit without training. {details}")
    add("--plan-device-memory", type=positive(float), metavar="GiB", help="one device's memory "
        "for --plan (default: the visible GPU's, else 80)")



def compile_problem(device):
    """--compile: why torch.compile cannot build code on device, found by compiling a function
    now (so a machine that cannot fails in one line, not at the first step), or None."""
    # Workaround: on a machine with a CUDA toolkit but no GPU, inductor's first import of
    # torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME=..." on every
    # rank (torch 2.14), which says nothing about a CPU run. Remove when it no longer does.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2, device=device))
    except Exception as e:
        return (f"--compile: torch.compile cannot build code here ({str(e).strip()[:200]}); "
                "install a C++ compiler (CPU) or Triton (GPU), or drop --compile")
    return None


def fsdp1_strategy(strategy):
    """The sharding strategy (its name) to give FSDP1: NO_SHARD where it has nothing to shard
    with, said on rank 0. FSDP1 would switch a world size of 1 to NO_SHARD itself, with a warning;
    and HYBRID_SHARD on nodes of one process each would reduce within each node only: each node
    would train on its own."""
    world_size, local_world_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    alone = world_size == 1 or (local_world_size == 1 and strategy == "HYBRID_SHARD")
    if strategy == "NO_SHARD" or not alone:
        return strategy
    rank0_print(f"{strategy} with one process{' per node' * (world_size > 1)}: NO_SHARD")
    return "NO_SHARD"
