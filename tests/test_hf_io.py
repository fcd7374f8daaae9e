"""t5_fsdp_finetune.py --fsdp-version 2 --cpu-ram-efficient-loading: every rank reads its shards
of the model from its safetensors files (DCP's HF reader); no rank holds the whole model."""
import glob
import shutil

import pytest
import torch
from conftest import LORA, t5_args, warning_lines

SCRIPT = "t5_fsdp_finetune.py"
SHARD_BY_SHARD = ["--cpu-ram-efficient-loading", "--fsdp-version", 2]  # test_t5.py's order: one run
# AdamW steps of at most 1e-30 change no weight of the tiny T5 in fp32 (nor does the decay, which
# multiplies them by 1 - 1e-32): its export holds the weights as loaded.
FROZEN = ["--lr", 1e-30]


def hf_tensors(folder):
    """The tensors of a save_pretrained directory's safetensors files, by name."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(f"{folder}/*.safetensors"))
    assert files, f"no safetensors in {folder}"
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def assert_same_tensors(got, expected):
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


@pytest.fixture
def t5_run(cached_torchrun, wikihow_dir):
    """t5_run(model_dir, *args, epochs=2, nproc=2): a cached run of the script."""

    def run(model_dir, *args, epochs=2, nproc=2):
        result = cached_torchrun(SCRIPT, *t5_args(model_dir, wikihow_dir, epochs, *args),
                                 nproc=nproc)
        assert result.returncode == 0, result.output
        assert warning_lines(result.output) == [], result.output
        return result

    return run


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_every_rank_reads_the_pretrained_weights(t5_run, tiny_t5_dir, untied_t5_dir, model):
    """Read shard by shard and exported without training (FROZEN): every parameter is
    from_pretrained's, tensor for tensor; a tied lm_head stays the embedding (one tensor in the
    HF files), an untied one keeps its own weights."""
    from transformers import T5ForConditionalGeneration

    model_dir = tiny_t5_dir if model == "tied" else untied_t5_dir
    run = t5_run(model_dir, *SHARD_BY_SHARD, *FROZEN, epochs=1)
    assert_same_tensors(torch.load(run.metrics["checkpoint_pt"], weights_only=True),
                        T5ForConditionalGeneration.from_pretrained(model_dir).state_dict())
    exported, files = hf_tensors(run.metrics["checkpoint"]), hf_tensors(model_dir)
    # (the untied export names the embedding's aliases too: its config says untied)
    assert_same_tensors({name: exported[name] for name in files}, files)
    assert ("lm_head.weight" in exported) == (model == "untied")


def test_an_export_seeds_a_run_at_another_world_size(t5_run, tiny_t5_dir):
    """A 2-rank run's export read shard by shard by one process: its first validation loss, before
    any weight changes (FROZEN), is the loss the 2-rank run logged for it, and its own export is
    the one it read, tensor for tensor."""
    seed = t5_run(tiny_t5_dir, *SHARD_BY_SHARD)
    run = t5_run(seed.metrics["checkpoint"], *SHARD_BY_SHARD, *FROZEN, epochs=1, nproc=1)
    assert run.metrics["world_size"] == 1
    assert run.metrics["val_losses"][0] == pytest.approx(seed.metrics["val_loss"], rel=1e-5)
    assert_same_tensors(hf_tensors(run.metrics["checkpoint"]),
                        hf_tensors(seed.metrics["checkpoint"]))


def test_a_model_without_safetensors_comes_from_rank_0(t5_run, tiny_t5_dir, tmp_path):
    """A model directory with a pytorch_model.bin (no safetensors): rank 0 loads it and broadcasts
    each rank's shards, as before, and says so in one line; the training is the same."""
    from transformers import T5ForConditionalGeneration

    folder = shutil.copytree(tiny_t5_dir, tmp_path / "bin_t5")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    torch.save(T5ForConditionalGeneration.from_pretrained(tiny_t5_dir).state_dict(),
               folder / "pytorch_model.bin")
    run = t5_run(folder, *SHARD_BY_SHARD, "--no-save-model")
    reference = t5_run(tiny_t5_dir, *SHARD_BY_SHARD)
    assert ("--cpu-ram-efficient-loading: the model has no safetensors files (a .bin): rank 0 "
            "loads it whole and broadcasts each rank's shards") in run.stdout.splitlines()
    assert "no safetensors" not in reference.stdout
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(reference.metrics[key], rel=1e-6)


def test_lora_adapters_start_as_peft_starts_them(t5_run, still_t5_dir):
    """With LoRA the files hold the base alone: each rank draws its shards of the adapters as PEFT
    does, from the whole matrices (A Kaiming-uniform, B zero), so that the model starts as the
    pretrained one: without training (FROZEN), its validation loss is the base model's, and its
    adapters are PEFT's (A within +-1/sqrt(fan in), spread as a uniform's, B zero)."""
    from safetensors.torch import load_file

    lora = t5_run(still_t5_dir, *LORA, *SHARD_BY_SHARD, *FROZEN, epochs=1)
    base = t5_run(still_t5_dir, *SHARD_BY_SHARD, *FROZEN, epochs=1)
    assert lora.metrics["val_losses"] == pytest.approx(base.metrics["val_losses"], rel=1e-6)
    adapters = load_file(f"{lora.metrics['adapter']}/adapter_model.safetensors")
    a = [tensor for name, tensor in adapters.items() if "lora_A" in name]
    b = [tensor for name, tensor in adapters.items() if "lora_B" in name]
    assert len(a) == len(b) == 12 and all(tensor.abs().max() < 1e-20 for tensor in b)
    for tensor in a:  # kaiming_uniform_(a=sqrt(5)): uniform on +-1/sqrt(fan in), std bound/sqrt(3)
        bound = tensor.shape[1] ** -0.5
        assert tensor.abs().max() <= bound and tensor.std() == pytest.approx(bound / 3 ** 0.5,
                                                                             rel=0.2)
