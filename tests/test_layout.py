"""The scripts read as lessons: the lesson first, one fenced plumbing block at the end, the same in
all four; and the README stays short and names only flags that exist."""
import ast
import re

import pytest
from conftest import REPO

# script -> (its model or data, the function that wraps/shards the model, its step)
LESSONS = {
    "fsdp1_mnist.py": ("Net", "wrap_model", "train"),
    "ddp_mnist.py": ("Net", "wrap_model", "train"),
    "fsdp2_transformer.py": ("Transformer", "shard_model", "train_step"),
    "t5_fsdp_finetune.py": ("load_model_and_tokenizer", "wrap_model", "train"),
}
FENCE = "# " + "=" * 98 + "\n# Plumbing"


def plumbing(script):
    text = (REPO / script).read_text()
    assert text.count(FENCE) == 1, f"{script} has no single fenced plumbing block"
    return text[text.index(FENCE):]


def test_plumbing_block_is_the_same_in_all_four_scripts():
    blocks = {script: plumbing(script) for script in LESSONS}
    assert len(set(blocks.values())) == 1, "the plumbing blocks differ: copy the fix to all four"
    assert blocks["fsdp1_mnist.py"].rstrip().endswith('if __name__ == "__main__":\n'
                                                      '    launch(parse_args())')


@pytest.mark.parametrize("script", list(LESSONS))
def test_the_lesson_comes_first(script):
    """Docstring (naming the wrapping function), imports, model/data, the wrap, the step, main and
    argparse, in that order; every plumbing function only after them, in the fenced block."""
    text = (REPO / script).read_text()
    tree = ast.parse(text)
    model, wrap, step = LESSONS[script]
    assert f"{wrap}()" in ast.get_docstring(tree), (
        "the docstring must say where the FSDP/DDP part is")
    fence_line = text[:text.index(FENCE)].count("\n") + 1
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    lines = {node.name: node.lineno for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    plumbing_names = {name for name in names if lines[name] > fence_line}
    assert {"launch", "fail", "Report", "init_process_group"} <= plumbing_names
    order = [lines[name] for name in (model, wrap, step, "main", "parse_args")]
    assert order == sorted(order) and order[-1] < fence_line, order
    first = min(lines.values())
    assert first == lines[model] or first < lines[wrap], "plumbing or helpers come before the model"
    assert all(len(line) <= 100 for line in text.splitlines())


def test_readme_is_short():
    assert len((REPO / "README.md").read_bytes()) <= 15_000


def readme_flags():
    """{script: flags the README names for it}: a flag counts for the scripts named on its line, or
    else for those of its section's heading (all four if it names none); lines about other programs
    (pip, pytest, the benchmark harness) and torchtitan's dotted flags are left out."""
    flags, scripts = {}, list(LESSONS)
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("#"):  # a heading naming no script speaks of all four
            scripts = [s for s in LESSONS if s in line] or list(LESSONS)
            continue
        named = [s for s in LESSONS if s in line]
        if not named and any(program in line for program in OTHER_PROGRAMS):
            continue
        named = named or scripts
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]+(?![\w.-])", line):
            for script in named:
                flags.setdefault(script, set()).add(flag)
    return flags


OTHER_PROGRAMS = ("pip ", "pytest", "benchmarks/run.py")
TORCHRUN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node-rank",
                  "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--standalone",
                  "--max-restarts"}


def test_every_flag_the_readme_names_is_in_help(help_text):
    flags = readme_flags()
    assert set(flags) == set(LESSONS), flags.keys()
    for script, named in flags.items():
        text = help_text(script)
        missing = sorted(f for f in named - TORCHRUN_FLAGS
                         if f"{f} " not in text and f"{f}," not in text)
        assert missing == [], f"README names {missing} for {script}, which its --help lacks"


def test_the_lock_meets_the_floors():
    """requirements-lock.txt (what CI installs) pins every runtime package of requirements.txt, at
    versions its floors admit."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "requirements-lock.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pinned = pins.get(canonicalize_name(requirement.name))
            assert pinned and requirement.specifier.contains(pinned), (line, pinned)
