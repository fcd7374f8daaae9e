"""Each lesson unit runs when copied alone: a reader who copies a piece (the sharding function, the
step, the checkpointer, the export) gets working code. For each script, the units a driver uses
are cut out of it with its imports but the safeguards package's and the one helper a unit may use
(rank0_print); a 2-rank gloo job under torchrun then does
a small real thing with them: a step whose loss is finite, a save then a load that round-trips
bit-identically, an export that from_pretrained opens. A unit that calls a safeguard fails here
with a NameError (the last test shows it). And a whole script copied with the safeguards package,
what the README says to copy, runs in an empty folder, launched by python and by torchrun."""
import ast
import shutil
import sys
import textwrap

import pytest
import torch
from conftest import MNIST_TINY, REPO, torchrun_command


def lesson_copy(script, units, text=None):
    """The source of a new file holding the script's imports (not the safeguards package's),
    rank0_print, and the units named with the definitions they use (what a reader copies along),
    in the script's order."""
    lesson = text or (REPO / script).read_text()
    lines = lesson.splitlines(keepends=True)
    imports, definitions = [], {}
    for node in ast.parse(lesson).body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith("safeguards"):
            continue
        start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else (
            node.lineno)
        source = "".join(lines[start - 1:node.end_lineno])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(source)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            definitions[node.name] = (node, source)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                definitions[target.id] = (node, source)
    wanted, todo = set(), list(units)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += [n.id for n in ast.walk(definitions[name][0])
                     if isinstance(n, ast.Name) and n.id in definitions]
    kept = dict.fromkeys(source for name, (_, source) in definitions.items() if name in wanted)
    return "".join(imports) + "\n\n" + "\n\n".join(kept) + "\n"


def copy_command(folder, script, units, driver, *args, text=None):
    """Write the copy of units plus driver into folder/lesson_copy.py; the command that runs it on
    2 ranks."""
    copy = folder / "lesson_copy.py"  # not copy.py, which would hide the standard module
    copy.write_text(lesson_copy(script, units, text) + driver)
    return torchrun_command(copy, args, 2)


def job(body):
    """The driver's code: body run as a function on every rank, so that its models are freed
    before the process group is (as the scripts' plumbing does: FSDP's reference cycles keep the
    group alive, and gloo's threads can abort an exit that frees it late). Under the main guard,
    as a script that saves asynchronously needs: DCP's writer is a spawned process, which imports
    the script first."""
    return ("import gc\nimport sys\n\n\ndef job():\n    rank = dist.get_rank()\n"
            + textwrap.indent(body, "    ") + "\n\nif __name__ == '__main__':\n"
            "    dist.init_process_group('gloo')\n    torch.manual_seed(0)\n    job()\n"
            "    gc.collect()\n    dist.destroy_process_group()\n")


FSDP2_DRIVER = job("""
from torch.distributed.tensor import DTensor


def same(a, b):
    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    return torch.equal(a, b)


def build(mesh, tp_plan=None, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(**config)
    model = shard_model(model, torch.device("cpu"), mesh, tp_plan=tp_plan)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


config = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, seq_len=16)
flat = init_device_mesh("cpu", (2,))  # FSDP over both ranks
tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))  # tensor parallel over them
model, optimizer = build(flat)
loss, grad_norm = train_step(model, optimizer, rank_batch(task_rules(64, 0), 8, 16, 0, rank, 2, 1))
assert torch.isfinite(loss) and torch.isfinite(grad_norm), (loss, grad_norm)
# The same model, tensor parallel: both ranks read the whole batch; the same loss and norm.
tp_model, tp_optimizer = build(tp_mesh, tensor_parallel_plan())
tp_loss, tp_norm = train_step(tp_model, tp_optimizer, rank_batch(task_rules(64, 0), 8, 16, 0, 0,
                                                                 1, 1))
assert torch.allclose(tp_loss, loss, rtol=1e-5) and torch.allclose(tp_norm, grad_norm, rtol=1e-5)
# Packed documents (--pack-documents' rows): in both layouts, the same loss and norm again.
loss, grad_norm = train_step(model, optimizer, rank_batch(task_rules(64, 0), 8, 16, 0, rank, 2, 2,
                                                          task=packed_batch))
tp_loss, tp_norm = train_step(tp_model, tp_optimizer, rank_batch(task_rules(64, 0), 8, 16, 0, 0,
                                                                 1, 2, task=packed_batch))
assert torch.allclose(tp_loss, loss, rtol=1e-5) and torch.allclose(tp_norm, grad_norm, rtol=1e-5)
for name, make in [("full", lambda folder: Checkpointer(folder, config)),
                   ("full, DCP API", lambda folder: Checkpointer(folder, config, dcp_api=True)),
                   ("sharded", lambda folder: Checkpointer(folder, config, "sharded")),
                   ("sharded async", lambda folder: AsyncCheckpointer(folder, config))]:
    for saved, saved_optimizer, mesh, plan in [(model, optimizer, tp_mesh, tensor_parallel_plan()),
                                               (tp_model, tp_optimizer, flat, None)]:
        folder = sys.argv[1] + "/" + name.replace(" ", "_").replace(",", "") + str(plan is None)
        saver = make(folder)
        saver.save(saved, saved_optimizer, step=1)
        saver.wait()
        dist.barrier()  # rank 0 has marked it complete: the other ranks may look for it now
        fresh, fresh_optimizer = build(mesh, plan, seed=1)  # the other layout, another init
        assert make(folder).load(fresh, fresh_optimizer, f"{folder}/step_000001") == 1, name
        assert all(same(a, b) for a, b in zip(saved.parameters(), fresh.parameters())), name
        for p, q in zip(saved.parameters(), fresh.parameters()):
            state, loaded = saved_optimizer.state[p], fresh_optimizer.state[q]
            assert state.keys() == loaded.keys() and all(same(state[k], loaded[k]) for k in state)
rank0_print("copied units: step, tensor parallel and packed steps and round trips across "
            "layouts ok")
""")


FSDP2_UNITS = ["Transformer", "tensor_parallel_plan", "shard_model", "train_step", "Checkpointer",
               "AsyncCheckpointer", "rank_batch", "task_rules", "packed_batch"]


def test_fsdp2_units_run_copied_alone():
    """The sharding, the tensor parallel plan, the step, the packed documents and the
    checkpointers, copied alone: a tensor parallel step has FSDP's loss and gradient norm, on the
    guide's rows and on packed documents, and a checkpoint saved by either layout loads into the
    other bit for bit, in every format."""
    run = copy_run("fsdp2")
    assert run.returncode == 0 and "round trips across layouts ok" in run.stdout, run.output


MNIST_DRIVER = job("""
from torch.utils.data import TensorDataset

images, labels = torch.randn(96, 1, 28, 28), torch.randint(0, 10, (96,))
data = TensorDataset(images, labels)
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=True, seed=0))
test_loader = DataLoader(data, batch_size=50, sampler=DistributedSampler(data, shuffle=False))
model = wrap_model(Net(), torch.device("cpu"), **WRAP)
optimizer = optim.Adadelta(model.parameters(), lr=1.0)
loss = train(model, torch.device("cpu"), loader, optimizer, epoch=1, dry_run=False)
test_loss, accuracy = test(model, torch.device("cpu"), test_loader, dry_run=False)
assert loss == loss and test_loss == test_loss and 0 <= accuracy <= 1
path = sys.argv[1] + "/mnist_cnn.pt"
save_model(model, path, **SAVE)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                            cpu_offload=False))
if rank == 0:
    plain = Net()
    plain.load_state_dict(torch.load(path, weights_only=True))
    assert all(torch.equal(value, full[key]) for key, value in plain.state_dict().items())
rank0_print("copied units: train, test, save and load ok")
""")


# FSDP1's save_model on CPU with cpu_offload=False, as the script passes there (offload_to_cpu:
# the offloading gather breaks in torch 2.11, requirements.txt's floor); DDP's has no such option.
MNIST_OPTIONS = {  # script: (wrap_model's keyword arguments, save_model's)
    "fsdp1_mnist.py": ("dict(auto_wrap_min_params=20000, sharding_strategy='FULL_SHARD', "
                       "cpu_offload=False, backward_prefetch='BACKWARD_PRE', "
                       "use_orig_params=False)", "dict(cpu_offload=False)"),
    "ddp_mnist.py": ("{}", "{}"),
}


@pytest.mark.parametrize("script", list(MNIST_OPTIONS))
def test_mnist_units_run_copied_alone(script):
    run = copy_run(script)
    assert run.returncode == 0 and "save and load ok" in run.stdout, run.output


T5_DRIVER = job("""
device = torch.device("cpu")
model_dir, data_dir, out = sys.argv[1:4]
from safetensors import safe_open

version, broadcast, lora = int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "1"
shards = sys.argv[7] == "1"  # FSDP2: every rank reads its shards from the model's safetensors
if version == 1 and broadcast:  # the script's workaround (a safeguard): FSDP1 refuses CPU tensors
    torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states = (
        lambda states: None)


def loaded(on_meta=False):
    model, tokenizer = load_model_and_tokenizer(model_dir, on_meta=on_meta)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as files:
        untied = "lm_head.weight" in files.keys()
    if on_meta and untied:  # the script's untie_as_the_weights (a safeguard): transformers ties
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    if lora:
        model = add_lora(model, 4, alpha=8, dropout=0.0, targets=["q", "v"],
                         base_dtype=torch.float32)
    return model, tokenizer


model, tokenizer = loaded(on_meta=shards or (broadcast and rank > 0))  # broadcast: from rank 0
tied = model.lm_head.weight is model.shared.weight
train_set, val_set = load_data(tokenizer, data_dir, 64, 24, num_train=16, num_val=8)
loader = rank_loader(train_set, 4, device, shuffle=True)
val_loader = rank_loader(val_set, 4, device)
mesh = device_mesh(device, hybrid=False)


def sharded(model, broadcast=False, shards=False):
    if version == 1:
        return wrap_model(model, mesh, device, sharding_strategy="FULL_SHARD",
                          mixed_precision=POLICIES["fp32"], backward_prefetch="BACKWARD_PRE",
                          limit_all_gathers=True, activation_checkpointing=True,
                          sync_module_states=broadcast)
    return shard_model(model, mesh, device, sharding_strategy="FULL_SHARD",
                       mp_policy=POLICIES_FSDP2["fp32"], activation_checkpointing=True,
                       broadcast_from_rank0=broadcast, weights=model_dir if shards else None)


model = sharded(model, broadcast, shards)
if version == 2:  # FSDP2 keeps the modules: materialized and loaded, the head is still tied
    assert (model.lm_head.weight is model.shared.weight) == tied
trained = [p for p in model.parameters() if p.requires_grad]
optimizer = optim.AdamW(trained, lr=0.002)
if version == 1 and lora:  # FSDP1 leaves the adapters whole on every rank
    optimizer.register_step_pre_hook(lambda *_: average_gradients(trained))
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
loss = train(model, loader, optimizer, None, epoch=1, device=device)
val_loss = validation(model, val_loader, device)
assert loss == loss and val_loss == val_loss
# micro_batches: at most 100 tokens each (the ranks get different numbers of them), the same loss
assert abs(validation(model, val_loader, device, max_tokens=100) - val_loss) < 1e-6 * val_loss
loss = train(model, loader, optimizer, None, epoch=2, device=device, max_tokens=100)
assert loss == loss
scheduler.step()
if version == 1:  # cpu_offload=False, as the script passes on CPU (torch 2.11 breaks there)
    export_model(model, tokenizer, out + "/best", cpu_offload=False)
else:  # FSDP2: the HF files from every rank's shards
    export_shards(model, tokenizer, out + "/best")
batch = next(iter(val_loader))
inputs = {"input_ids": batch["source_ids"], "attention_mask": batch["source_mask"],
          "labels": batch["target_ids"], "use_cache": False}
model.eval()  # no dropout: the same logits as the exports'
with torch.no_grad():
    logits = model(**inputs).logits  # FSDP gathers the parameters for this forward
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                            cpu_offload=False))
if rank == 0:
    opened = T5ForConditionalGeneration.from_pretrained(out + "/best-hf").eval()
    assert (opened.lm_head.weight is opened.shared.weight) == tied
    if not lora:  # with LoRA, the merged model: the adapters' products in the weights
        assert all(torch.equal(opened.state_dict()[key], value) for key, value in full.items())
    with torch.no_grad():
        assert torch.allclose(opened(**inputs).logits, logits, rtol=1e-5, atol=1e-5)
    if lora:  # the adapters on the pretrained model, as PEFT opens them
        from peft import PeftModel
        base = T5ForConditionalGeneration.from_pretrained(model_dir)
        adapted = PeftModel.from_pretrained(base, out + "/best-adapter").eval()
        with torch.no_grad():
            assert torch.allclose(adapted(**inputs).logits, logits, rtol=1e-5, atol=1e-5)
    T5Tokenizer.from_pretrained(out + "/best-hf")
state = {"epoch": 1, "scheduler": scheduler.state_dict()}
save_sharded_checkpoint(model, optimizer, state, out + "/checkpoint-epoch-1")  # ends in a barrier
fresh = sharded(loaded()[0])
fresh_optimizer = optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.002)
fresh_scheduler = StepLR(fresh_optimizer, step_size=1, gamma=0.7)
loaded_state = load_sharded_checkpoint(out + "/checkpoint-epoch-1", fresh, fresh_optimizer,
                                       fresh_scheduler, None)
again = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True,
                                                             cpu_offload=False))
assert loaded_state["epoch"] == 1 and fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
assert all(torch.equal(again[key], value) for key, value in full.items())
rank0_print("copied units: train, validation, export (same logits) and round trip ok")
""")
T5_UNITS = ["load_model_and_tokenizer", "add_lora", "load_data", "rank_loader", "device_mesh",
            "micro_batches", "train", "validation", "save_sharded_checkpoint",
            "load_sharded_checkpoint"]


T5_MODELS = [(1, "tied, weights from rank 0, LoRA"), (2, "tied, weights from rank 0"),
             (2, "untied, read shard by shard, LoRA")]


@pytest.mark.parametrize("version, model", T5_MODELS)
def test_t5_units_run_copied_alone(version, model):
    """wrap_model (FSDP1) or shard_model (FSDP2) copied alone with the units around them: a tied
    T5 (t5-small style) whose weights only rank 0 loads (FSDP1: materialize_on and
    sync_module_states; FSDP2: broadcast), and an untied one (flan-t5 style) whose ranks read
    their shards from its safetensors (load_pretrained_shards); with LoRA adapters (add_lora) on
    two of them. FSDP1 exports from the gathered model (export_model), FSDP2 shard by shard
    (export_shards). The exports open with from_pretrained (and PEFT's adapters with
    PeftModel.from_pretrained), and their logits equal the sharded model's; the sharded
    checkpoint (with LoRA, of the adapters alone) round-trips into a freshly loaded model."""
    run = copy_run(f"t5 {version}, {model}")
    assert run.returncode == 0 and "round trip ok" in run.stdout, run.output
    assert (run.cwd / "best.pt").exists() == (version == 1) and not list(run.cwd.glob("*.tmp"))


def test_a_unit_that_calls_a_safeguard_does_not_run_copied():
    """The check above catches what it is for: train_step made to call a safeguard (describe_fsdp2)
    fails in its copy, where the safeguards are not."""
    run = copy_run("fsdp2, train_step calling a safeguard")
    assert run.returncode != 0 and "NameError: name 'describe_fsdp2' is not defined" in run.output


# A whole script copied with the safeguards package into an empty folder: what the README tells a
# user to copy. Real new processes (the queue's), launched both ways.
FSDP2_ARGS = ["--cpu", "--steps", "6", "--log-every", "2", "--checkpoint-dir", "ckpt",
              "--checkpoint-format", "sharded"]


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_fsdp2_copied_with_the_module_runs_both_ways(launcher):
    """fsdp2_transformer.py and safeguards/ alone in a folder: `python fsdp2_transformer.py`
    (two processes it spawns) and torchrun both train, checkpoint, and give the same losses."""
    run = copy_run(f"fsdp2 and safeguards, {launcher}")
    assert run.returncode == 0, run.output
    assert sorted(path.name for path in run.cwd.iterdir() if path.suffix == ".py") == [
        "fsdp2_transformer.py"]
    assert (run.cwd / "safeguards" / "launch.py").exists()
    assert run.metrics["script"] == "fsdp2_transformer.py" and run.metrics["world_size"] == 2
    assert (run.cwd / "ckpt" / "step_000006" / "COMPLETE").exists()
    other = copy_run(f"fsdp2 and safeguards, {({'python', 'torchrun'} - {launcher}).pop()}")
    assert run.metrics["losses"] == other.metrics["losses"]


def test_ddp_mnist_copied_with_the_module_runs():
    """ddp_mnist.py and safeguards/ alone in a folder: `python ddp_mnist.py` trains, tests
    and saves mnist_cnn.pt, which loads into a plain Net."""
    run = copy_run("ddp_mnist and safeguards")
    assert run.returncode == 0, run.output
    assert run.metrics["script"] == "ddp_mnist.py" and run.metrics["accuracy"] > 0.3
    state = torch.load(run.cwd / "mnist_cnn.pt", weights_only=True)
    assert state["fc2.weight"].shape == (10, 128)


# ---------------------------------------------------------------------------------- the runs
def copy_commands(folder, fixture):
    """{name: a function that writes a copy into folder and gives the command that runs it}, for
    every copy the tests above run; fixture(name) gives a session fixture's value."""
    def fsdp2(text=None):
        return copy_command(folder, "fsdp2_transformer.py", FSDP2_UNITS, FSDP2_DRIVER, folder,
                            text=text)

    def mnist(script):
        wrap, save = MNIST_OPTIONS[script]
        return copy_command(folder, script, ["Net", "wrap_model", "train", "test", "save_model"],
                            f"WRAP = {wrap}\nSAVE = {save}\n" + MNIST_DRIVER, folder)

    def t5(version, model):
        shutil.copy(REPO / "summarization_dataset.py", folder)  # the lesson imports it
        units = T5_UNITS + (["wrap_model", "average_gradients", "POLICIES", "export_model"]
                            if version == 1 else [
            "shard_model", "POLICIES_FSDP2", "hf_state", "load_pretrained_shards",
            "export_shards"])
        tied = model.startswith("tied")
        return copy_command(folder, "t5_fsdp_finetune.py", units, T5_DRIVER,
                            fixture("tiny_t5_dir" if tied else "untied_t5_dir"),
                            fixture("wikihow_dir"), folder, version, int("rank 0" in model),
                            int("LoRA" in model), int("shard by shard" in model))

    def safeguard_called():
        text = (REPO / "fsdp2_transformer.py").read_text()
        step = "    optimizer.zero_grad()\n"
        assert step in text
        return fsdp2(text=text.replace(step, step + "    describe_fsdp2(model, model.layers)\n", 1))

    def whole(script, *args, launcher="python"):
        shutil.copy(REPO / script, folder)
        shutil.copytree(REPO / "safeguards", folder / "safeguards",
                        ignore=shutil.ignore_patterns("__pycache__"))
        start = [sys.executable] if launcher == "python" else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 2]
        return [*start, folder / script, *args, "--metrics-json", folder / "metrics.json"]

    return {"fsdp2 and safeguards, python": lambda: whole("fsdp2_transformer.py", *FSDP2_ARGS),
            "fsdp2 and safeguards, torchrun": lambda: whole("fsdp2_transformer.py", *FSDP2_ARGS,
                                                             launcher="torchrun"),
            "ddp_mnist and safeguards": lambda: whole(
                "ddp_mnist.py", "--cpu", "--epochs", 1, "--data-dir", fixture("mnist_dir"),
                "--save-model", *MNIST_TINY),
            **{f"t5 {version}, {model}": lambda v=version, m=model: t5(v, m)
               for version, model in T5_MODELS},
            "fsdp2": fsdp2, "fsdp2, train_step calling a safeguard": safeguard_called,
            **{script: lambda s=script: mnist(s) for script in MNIST_OPTIONS}}


RUNS = {}  # name: the future of its Run (start_early)


def case_of(item):
    """The name of the copy the test item reads."""
    params = getattr(item, "callspec", None) and item.callspec.params
    if item.originalname == "test_fsdp2_copied_with_the_module_runs_both_ways":
        return [f"fsdp2 and safeguards, {launcher}" for launcher in ("python", "torchrun")]
    return {"test_fsdp2_units_run_copied_alone": "fsdp2",
            "test_ddp_mnist_copied_with_the_module_runs": "ddp_mnist and safeguards",
            "test_a_unit_that_calls_a_safeguard_does_not_run_copied":
                "fsdp2, train_step calling a safeguard",
            "test_mnist_units_run_copied_alone": params and params.get("script"),
            "test_t5_units_run_copied_alone": params and f"t5 {params.get('version')}, "
                                                         f"{params.get('model')}",
            }[item.originalname]


def start_early(request):
    """Queue the selected tests' copies as the session starts (conftest): they run one at a time,
    at the lowest priority, on the cores the other tests leave idle, in folders of their own, and
    this file's tests, which run last, wait for theirs. The T5 copies, the longest, go first."""
    queue = request.getfixturevalue("idle_queue")
    factory, fixture = request.getfixturevalue("tmp_path_factory"), request.getfixturevalue
    selected = set()
    for item in request.session.items:
        if getattr(item, "module", None) is sys.modules[__name__]:
            case = case_of(item)
            selected |= set(case) if isinstance(case, list) else {case}
    for name in copy_commands(None, fixture):
        if name in selected:
            folder = factory.mktemp("copy")
            RUNS[name] = queue.run(copy_commands(folder, fixture)[name](), folder, timeout=900)


def copy_run(name):
    return RUNS[name].result(timeout=1800)
