"""--plan, for the planners of fsdp2_transformer.py and t5_fsdp_finetune.py: the world size and
device memory to plan for, the plan as a table, written to --metrics-json, and the exit."""
import os
import sys

import torch

from .errors import rank0_print
from .report import write_json

PLAN_RANKS = (1, 2, 4, 8, 16, 32, 64)  # the world sizes a plan compares


def plan_sizes(args):
    """(world size, processes per node, one device's GiB) that --plan plans for: those of the
    launch these flags make (under torchrun, its own), and the visible GPU's memory."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size or (
        torch.cuda.device_count() if use_cuda else 0) or 2))
    device_gib = args.plan_device_memory or (
        torch.cuda.get_device_properties(0).total_memory / 2**30 if use_cuda else 80)
    return world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), device_gib


def aligned(header, rows):
    """The table's lines: cells " | "-separated, each column as wide as its widest cell, so that
    figures stay under their heading whatever their size (the last column, words, is not padded;
    a row of two cells is a remark about its first)."""
    widths = [max(len(row[i]) for row in (header, *rows) if len(row) > i + 1)
              for i in range(len(header) - 1)]
    return [" | ".join([*(cell.rjust(width) for cell, width in zip(row[:-1], widths)), row[-1]])
            for row in (header, *rows)]


def scale_of(plan):
    """(bytes per unit, unit) in which to show a plan's figures."""
    return (2**30, "GiB") if plan["peak_bytes"] >= 2**30 else (2**20, "MiB")


def figure_lines(rows, plan, device_gib):
    """The lines of (name, bytes) rows, then whether the predicted peak fits one device."""
    scale, _ = scale_of(plan)
    lines = [f"  {name:<48}{value / scale:10.2f}" for name, value in rows]
    lines.append(f"  {'fits one device of (GiB)':<48}{device_gib:10.2f}  "
                 + ("yes" if plan["fits"] else "NO"))
    return lines


def print_plan(text, plan, metrics_json, script):
    """Rank 0 prints the plan's text and writes the plan to metrics_json; then exit 0."""
    rank0_print(text)
    if metrics_json and int(os.environ.get("RANK", "0")) == 0:
        write_json(metrics_json, {"script": script, "plan": plan})
    sys.exit(0)
