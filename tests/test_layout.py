"""The scripts read as their lessons and the safeguards live in one package beside them: the
package imports no script, no class outside a script subclasses one of the script's classes, each
lesson unit copies alone, no block of code is written twice, and each file stays within its
ceiling; the README stays short and names only flags that exist."""
import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize

import pytest
from conftest import REPO

# script -> (its model or data, the function that wraps/shards the model, its step)
LESSONS = {
    "fsdp1_mnist.py": ("Net", "wrap_model", "train"),
    "ddp_mnist.py": ("Net", "wrap_model", "train"),
    "fsdp2_transformer.py": ("Transformer", "shard_model", "train_step"),
    "t5_fsdp_finetune.py": ("load_model_and_tokenizer", "wrap_model", "train"),
}
PACKAGE = REPO / "safeguards"
MODULES = sorted(PACKAGE.glob("*.py"))
# The most lines a file may hold: a script is its recipe, a module of the package one concern.
CEILINGS = {"fsdp2_transformer.py": 850, "t5_fsdp_finetune.py": 850, "fsdp1_mnist.py": 260,
            "ddp_mnist.py": 220}
MODULE_CEILING = 400
# The API calls a reader comes for: each must be in the script's code (not only in a comment).
ESSENTIAL = {
    "fsdp2_transformer.py": [
        "fully_shard(", "MixedPrecisionPolicy(", "CPUOffloadPolicy(",
        ".set_modules_to_forward_prefetch(", ".set_modules_to_backward_prefetch(",
        ".set_requires_gradient_sync(", "clip_grad_norm_(", ".to_empty(", ".reset_parameters(",
        ".full_tensor(", "distribute_tensor(", "dcp.save(", "dcp.async_save(", "dcp.load(",
        "get_model_state_dict(", "set_model_state_dict(", "init_device_mesh(", ".unshard(",
        "torch.optim.AdamW(", "checkpoint(", ".compile(", "AsyncCheckpointerType.PROCESS",
        "StagingOptions(", ".register_step_pre_hook(", "parallelize_module(", "ColwiseParallel(",
        "RowwiseParallel(", "SequenceParallel(", "PrepareModuleInput(", "loss_parallel("],
    "t5_fsdp_finetune.py": [
        "FSDP(", "CustomPolicy(", "MixedPrecision(", "ShardedGradScaler(",
        "apply_activation_checkpointing(", "BackwardPrefetch", "ShardingStrategy",
        "get_model_state_dict(", "dcp.save(", "dcp.load(", "DistributedSampler(",
        "optim.AdamW(", "StepLR(", "fully_shard(", "init_device_mesh(", "LoraConfig(",
        "get_peft_model(", ".merge_and_unload(", "set_state_dict(", "HuggingFaceStorageReader("],
    "fsdp1_mnist.py": [
        "FSDP(", "size_based_auto_wrap_policy", "ShardingStrategy", "BackwardPrefetch",
        "CPUOffload(", "get_model_state_dict(", "DistributedSampler(", "optim.Adadelta(",
        "StepLR("],
    "ddp_mnist.py": [
        "DistributedDataParallel(", "get_model_state_dict(", "DistributedSampler(",
        "optim.Adadelta(", "StepLR("],
}


def code_only(source):
    """source without its comments and string literals (docstrings included)."""
    kept = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type not in (tokenize.COMMENT, tokenize.STRING)]
    return " ".join(kept).replace(" . ", ".").replace(" (", "(").replace(". ", ".")


def definitions(tree):
    return [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]


def imports(tree):
    """The modules a module's import statements name (a relative one as ".name")."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def parsed(path):
    return ast.parse(path.read_text())


def support_names(tree):
    """The names a script imports from the safeguards package."""
    return {alias.asname or alias.name for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safeguards")
            for alias in node.names}


def test_the_package_imports_no_script_and_each_script_imports_only_it():
    """No import circle: no module of the safeguards package imports a script (a script hands it
    values: its main, its model class, its checkpointer); each script imports the package and no
    other script (T5 also its dataset module)."""
    scripts = {path.stem for path in REPO.glob("*.py")} - {"summarization_dataset"}
    for module in MODULES:
        named = {name.split(".")[0] for name in imports(parsed(module))}
        assert named & scripts == set(), f"{module.name} imports {named & scripts}"
    for script in LESSONS:
        ours = {name.split(".")[0] for name in imports(parsed(REPO / script))} & (
            scripts | {"safeguards", "summarization_dataset"})
        assert ours == {"safeguards"} | ({"summarization_dataset"} if "t5" in script else set())


def classes_subclassing(tree, names):
    """The classes of tree whose bases name one of names (directly, or as module.name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {getattr(base, "id", None) or getattr(base, "attr", None)
                     for base in node.bases}
            found += [f"{node.name}({', '.join(sorted(bases & names))})"] if bases & names else []
    return found


def test_no_class_of_a_script_is_subclassed_outside_it():
    """The lesson's classes are the ones that run, as their code says: nothing in the package, the
    other scripts or the benchmarks subclasses one (a subclass that overrides a Checkpointer's
    methods would change the lesson behind the reader's back)."""
    outside = [*MODULES, *REPO.glob("*.py"), *REPO.glob("benchmarks/**/*.py")]
    for script in LESSONS:
        classes = {node.name for node in definitions(parsed(REPO / script))
                   if isinstance(node, ast.ClassDef)}
        for path in outside:
            tree = parsed(path)
            own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
            if path.name != script:  # (a class of the same name there is that file's own)
                assert classes_subclassing(tree, classes - own) == [], (script, path.name)


def test_a_subclass_outside_the_script_is_caught():
    """The check above fails where it should: a package class built on a lesson's Checkpointer."""
    tree = ast.parse("class CheckedCheckpointer(script.Checkpointer):\n    pass\n")
    assert classes_subclassing(tree, {"Checkpointer"}) == ["CheckedCheckpointer(Checkpointer)"]


def six_line_blocks(path, skip=None):
    """{the text of each run of six code lines of path (stripped; blank lines, comments, lines of
    brackets alone and import statements left out): its first line number}; skip(line number)
    leaves a line out too."""
    blocks, kept, text = {}, [], path.read_text()
    imported = {number for node in ast.parse(text).body if isinstance(node, (ast.Import,
                ast.ImportFrom)) for number in range(node.lineno, node.end_lineno + 1)}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#") and re.search(r"\w", line) and not (
                number in imported or skip and skip(number)):
            kept.append((number, line))
    for i in range(len(kept) - 5):
        blocks.setdefault("\n".join(line for _, line in kept[i:i + 6]), kept[i][0])
    return blocks


def test_no_block_of_six_lines_is_written_twice():
    """What several files need is said once, in one module of the package: no run of six code
    lines stands in two of the scripts and the package's modules (the names each imports aside).
    One exception, by design: the two MNIST scripts are the same program but for the wrapping
    (ddp_mnist.py is the baseline fsdp1_mnist.py is compared with), and each is copied alone."""
    files = [*(REPO / script for script in LESSONS), *MODULES]
    blocks = {path: six_line_blocks(path) for path in files}
    shared = []
    for i, a in enumerate(files):
        for b in files[i + 1:]:
            if {a.name, b.name} == {"fsdp1_mnist.py", "ddp_mnist.py"}:
                continue
            shared += [f"{a.name}:{blocks[a][text]} = {b.name}:{blocks[b][text]}"
                       for text in blocks[a].keys() & blocks[b].keys()]
    assert shared == [], shared


def test_nothing_writes_onto_args():
    """A lesson that read an attribute set by a check would run only where the check ran first."""
    for path in [*(REPO / script for script in LESSONS), *MODULES]:
        written = sorted({f"args.{n.attr}" for n in ast.walk(parsed(path))
                          if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                          and getattr(n.value, "id", "") == "args"})
        assert written == [], f"{path.name} writes {written}"


@pytest.mark.parametrize("path", [*(REPO / script for script in LESSONS), *MODULES],
                         ids=lambda path: path.name)
def test_every_definition_is_used(path):
    """No dead code: each top-level definition of a script is named somewhere else in it; each of
    the package's, in the package or in a script."""
    def named_in(tree, skip=()):
        names = set()
        for node in tree.body:
            defined = {node.name} if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else set()
            if node in skip:
                continue
            names |= {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                      if isinstance(n, (ast.Name, ast.Attribute))} - defined
        return names

    tree = parsed(path)
    named = named_in(tree)
    if path.parent == PACKAGE:
        for other in [*MODULES, *(REPO / script for script in LESSONS)]:
            if other != path:
                named |= named_in(parsed(other)) | {alias.name for node in ast.walk(parsed(other))
                                                    if isinstance(node, ast.ImportFrom)
                                                    for alias in node.names}
    defined = {node.name for node in definitions(tree)} | {
        target.id for node in tree.body if isinstance(node, ast.Assign)
        for target in node.targets if isinstance(target, ast.Name)}
    assert sorted(defined - named) == [], f"{path.name}: defined but never used"


@pytest.mark.parametrize("script", list(LESSONS))
def test_each_lesson_unit_copies_with_at_most_rank0_print(script):
    """What ../shared/tools/copy_closure.py measures: following the names each top-level
    definition uses, transitively, none reaches a name the script imports from the safeguards
    package (main and parse_args apply and declare them); rank0_print is the lesson's own."""
    tree = parsed(REPO / script)
    nodes = {node.name: node for node in definitions(tree)}
    nodes.update({target.id: node for node in tree.body if isinstance(node, ast.Assign)
                  for target in node.targets if isinstance(target, ast.Name)})
    support = support_names(tree)

    def names(node):
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    for unit in set(nodes) - {"main", "parse_args"}:
        seen, todo = set(), names(nodes[unit])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo |= names(nodes[name]) if name in nodes else set()
        assert sorted(seen & support) == [], f"{script}: {unit} needs {sorted(seen & support)}"


@pytest.mark.parametrize("script", list(LESSONS))
def test_the_recipe_reads_top_to_bottom(script):
    """Docstring (naming the wrapping function), imports, model/data, the wrap, the step, main and
    argparse, in that order, within the script's ceiling."""
    text = (REPO / script).read_text()
    tree = ast.parse(text)
    model, wrap, step = LESSONS[script]
    assert f"{wrap}()" in ast.get_docstring(tree), (
        "the docstring must say where the FSDP/DDP part is")
    assert text.count("\n") <= CEILINGS[script], f"{script} has {text.count(chr(10))} lines"
    lines = {node.name: node.lineno for node in definitions(tree)}
    order = [lines[name] for name in (model, wrap, step, "main", "parse_args")]
    assert order == sorted(order) and max(lines.values()) == lines["parse_args"], order
    first = min(lines.values())
    assert first == lines[model] or first < lines[wrap], "helpers come before the model"
    assert all(len(line) <= 100 for line in text.splitlines())
    assert text.rstrip().splitlines()[-1].startswith("    launch(") or "launch(main," in text


@pytest.mark.parametrize("module", MODULES, ids=lambda path: path.name)
def test_each_module_of_the_package_holds_one_concern(module):
    """At most 400 lines, and a docstring that says what it holds."""
    text = module.read_text()
    assert text.count("\n") <= MODULE_CEILING and ast.get_docstring(ast.parse(text)), module.name


@pytest.mark.parametrize("script", list(LESSONS))
def test_the_essential_calls_are_in_the_script(script):
    code = code_only((REPO / script).read_text())
    missing = [call for call in ESSENTIAL[script] if call not in code]
    assert missing == [], f"{script}: {missing} are not in its code"


def takers_of_args(tree, allowed):
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and not allowed(node.name)
            and "args" in [a.arg for a in node.args.args + node.args.kwonlyargs]]


def test_functions_take_the_values_they_use():
    """In a script only main and parse_args take `args`; in the package, only the checks of the
    flags (*_problem), the choices they make, --plan's entry, the resume line's and the launcher,
    which hands them to main."""
    for script in LESSONS:
        assert takers_of_args(parsed(REPO / script), {"main", "parse_args"}.__contains__) == []
    entries = {"plan_and_exit", "plan_sizes", "resume_hint", "lora_settings", "sharding_choice",
               "launch", "spawn_worker", "run_worker"}  # (the launcher hands args to main)
    for module in MODULES:
        taken = takers_of_args(parsed(module),
                               lambda name: name.endswith("problem") or name in entries)
        assert taken == [], f"{module.name}: {taken} take args; pass them the values they use"


@pytest.mark.parametrize("script", list(LESSONS))
def test_help_groups_the_flags(script):
    """parse_args() puts its flags in named groups (model, data, FSDP, checkpointing, run...): its
    own, and the package's add_run_flags()."""
    parse_args = next(node for node in definitions(parsed(REPO / script))
                      if node.name == "parse_args")
    groups = [node for node in ast.walk(parse_args) if isinstance(node, ast.Call) and (
        getattr(node.func, "attr", None) == "add_argument_group"
        or getattr(node.func, "id", None) == "add_run_flags")]
    assert len(groups) >= 3, f"{script}: {len(groups)} argument groups"


def test_both_checkpointing_scripts_resume_from_the_same_kind_of_folder(tmp_path):
    """fsdp2's step_N/COMPLETE (torchtitan's) and T5's checkpoint-epoch-N/trainer_state.json (HF
    Trainer's) are found by one newest_complete: the highest N whose marker is there, not a .tmp
    (a save cut short, even with its marker) nor a folder without its marker."""
    from safeguards.checkpoints import newest_complete

    for prefix, marker in [("step_", "COMPLETE"), ("checkpoint-epoch-", "trainer_state.json")]:
        folder = tmp_path / prefix
        for name, complete in [("2", True), ("10", True), ("9", True), ("11.tmp", True),
                               ("12", False), ("x13", True)]:
            (folder / f"{prefix}{name}").mkdir(parents=True)
            if complete:
                (folder / f"{prefix}{name}" / marker).write_text("{}")
        assert newest_complete(str(folder), prefix, marker) == str(folder / f"{prefix}10")
        assert newest_complete(str(tmp_path / "none"), prefix, marker) is None


def test_the_smoke_tier_covers_every_script(tmp_path):
    """python -m pytest -m smoke runs, for each of the four scripts, tests that name it (with
    @SMOKE(script)); collected here as pytest would, without running them."""
    listing = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "smoke",
                           "-p", "no:cacheprovider", str(REPO / "tests")], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SMOKE_SCRIPTS_FILE": str(listing)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(listing.read_text()) == sorted(LESSONS)
    assert len(re.findall(r"::test_", proc.stdout)) >= 2 * len(LESSONS), proc.stdout


@pytest.mark.parametrize("script", ["fsdp1_mnist.py", "t5_fsdp_finetune.py"])
def test_fsdp1_scripts_point_to_fsdp2(script):
    """FSDP1 is the older API: its scripts say so and point new code to fsdp2_transformer.py."""
    docstring = ast.get_docstring(ast.parse((REPO / script).read_text()))
    assert "fsdp2_transformer.py" in docstring and "FSDP2" in docstring


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
SLURM_FLAGS = {"--nodes", "--gpus-per-node", "--ntasks-per-node", "--kill-on-bad-exit",
               "--partition", "--account", "--time"}


def test_every_flag_the_readme_names_is_in_help(help_text):
    flags = readme_flags()
    assert set(flags) == set(LESSONS), flags.keys()
    for script, named in flags.items():
        text = help_text(script)
        missing = sorted(f for f in named - TORCHRUN_FLAGS - SLURM_FLAGS
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


def test_the_readme_sections_the_code_cites_exist():
    """A message or docstring that sends the reader to a README section ("README.md, 'Data'",
    "benchmarks/README.md, 'Lock-step check'") names a heading that README has (an error pointed
    to "Getting the data", which it had not); a citation may run over two lines."""
    headings = {readme: {line.lstrip("#").strip() for line in (REPO / readme).read_text()
                         .splitlines() if line.startswith("#")}
                for readme in ("README.md", "benchmarks/README.md")}
    cited = {}
    for path in [*REPO.glob("*.py"), *PACKAGE.glob("*.py"), *REPO.glob("benchmarks/*.py")]:
        for readme, section in re.findall(r"((?:benchmarks/)?README\.md), [\"']([^\"']+)[\"']",
                                          " ".join(path.read_text().split())):
            cited.setdefault((readme, section), []).append(path.name)
    assert cited, "no citation found: the pattern no longer matches how the code cites"
    assert {s: files for s, files in cited.items() if s[1] not in headings[s[0]]} == {}


@pytest.mark.parametrize("script", LESSONS)
def test_help_gives_a_default_only_where_it_says_something(help_text, script):
    """No "(default: None)" or "(default: False)" (a switch is off unless given), and no default
    said twice; the defaults of valued flags are still there."""
    text = help_text(script)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"\(default[^()]*(\([^()]*\))?[^()]*\) \(default: ", text), text
    assert "(default: 600)" in text  # --dist-timeout, in every script


@pytest.mark.parametrize("helper", ["digits_mnist.py", "tiny_wikihow.py"])
def test_the_helper_scripts_explain_themselves(tmp_path, helper):
    """`python tests/<helper> --help` (the README's offline data) prints its usage and exits 0,
    writing nothing (digits_mnist.py made a folder named --help)."""
    run = subprocess.run([sys.executable, REPO / "tests" / helper, "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stderr
    assert "data_dir" in run.stdout and list(tmp_path.iterdir()) == []
