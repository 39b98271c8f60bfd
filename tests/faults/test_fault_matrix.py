"""Nothing lost, nothing exhausted: sizes from a checkpoint checked before allocation, crash-consistent writes on a
full disk, and the fault matrix (``benchmarks/fault_injection/matrix.py``; ``python benchmarks/faults.py --matrix``).

Full disks are real small filesystems (a tmpfs mounted by the test, which needs root / CAP_SYS_ADMIN: the tests that
need one skip without it, saying so).
"""

import json
import time
from pathlib import Path

import pytest
import torch
from matrix import HOSTILE, Matrix, can_mount, filesystem, table

from lightning_muon.callbacks.generation import append_jsonl
from lightning_muon.checkpoint import StorageError, atomic_save, checkpoint_problem
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import TINY_DIT
from lightning_muon.recipes.trust import SizeMismatch, check_sizes, checked_checkpoint, planned_shapes

needs_mount = pytest.mark.skipif(not can_mount(), reason="mounting a small tmpfs needs root (CAP_SYS_ADMIN)")


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def default_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the default run's module (what ``lightning-muon fit`` writes, without training)."""
    module = DiTModule()
    module.configure_model()
    state = {f"model.{k}": v for k, v in module.model.state_dict().items()}
    state |= {f"ema.{k}": v for k, v in module.ema.state_dict().items()}
    path = tmp_path_factory.mktemp("ckpt") / "default.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": 3}, path)
    return path


def hostile(source: Path, target: Path, **changes) -> Path:
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["hyper_parameters"] = {**checkpoint["hyper_parameters"], **changes}
    torch.save(checkpoint, target)
    return target


def test_hostile_sizes_are_refused_in_under_a_second_with_memory_flat(default_checkpoint, tmp_path):
    """200,000 layers of 64 heads × 128 (the issue's checkpoint); then each size a file declares, one at a time."""
    assert checked_checkpoint(default_checkpoint, DiTModule)["muon"]["period"] == 3  # the control: the true sizes pass
    cases = {
        "num_layers": {"model_config": {**TINY_DIT, **HOSTILE}},
        "pos_embed.proj.weight": {"model_config": {**TINY_DIT, "num_attention_heads": 64, "attention_head_dim": 128}},
        "sample_size": {"model_config": {**TINY_DIT, "sample_size": 1 << 16}},
        "class_embedder": {"model_config": {**TINY_DIT, "num_embeds_ada_norm": 10**9}},
        "num_classes": {"num_classes": 10**9},
        "in_channels": {"model_config": {**TINY_DIT, "in_channels": 4}},
    }
    for named, changes in cases.items():
        path = hostile(default_checkpoint, tmp_path / f"{named}.ckpt", **changes)
        before, start = resident_mib(), time.perf_counter()
        with pytest.raises(SizeMismatch, match=named) as info:
            checked_checkpoint(path, DiTModule)
        seconds, grown = time.perf_counter() - start, resident_mib() - before
        assert seconds < 1.0 and grown < 50, (named, seconds, grown)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_control_without_the_check_a_config_of_1000_layers_costs_seconds_and_memory(default_checkpoint):
    """The same meta-device build with no budget (what ``evaluate`` did at 9ea84c0, before any check): 1,000 of the
    hostile layers already take seconds and tens of MiB; the issue's 200,000 grew past 3.3 GB."""
    config = {**TINY_DIT, **HOSTILE, "num_layers": 1000}
    before, start = resident_mib(), time.perf_counter()
    planned_shapes("dit", config, max_tensors=10**9)
    assert time.perf_counter() - start > 1.0 or resident_mib() - before > 50
    with pytest.raises(SizeMismatch, match="more than 100 tensors"):  # with a budget it stops at once
        planned_shapes("dit", config, max_tensors=100)


def test_every_loader_checks_the_sizes_first(default_checkpoint, tmp_path):
    from lightning_muon.recipes.evaluate import load_generator

    path = hostile(default_checkpoint, tmp_path / "h.ckpt", model_config={**TINY_DIT, **HOSTILE})
    for load in (lambda: load_generator(path, torch.device("cpu")), lambda: DiTModule.load_from_checkpoint(path)):
        with pytest.raises(ValueError, match="num_layers is 200000, the file holds 4"):
            load()


def test_a_caption_length_beyond_the_text_encoders_positions_is_refused(tmp_path):
    from helpers import tiny_text_encoder

    from lightning_muon.recipes.networks import PromptEncoder

    tiny_text_encoder(tmp_path / "t5")
    assert PromptEncoder(str(tmp_path / "t5"), 512).max_length == 512  # T5's n_positions: the control passes
    with pytest.raises(ValueError, match=r"max_caption_length must be in \[1, 512\]"):
        PromptEncoder(str(tmp_path / "t5"), 10**9)


def test_check_sizes_names_a_missing_or_extra_tensor(default_checkpoint):
    from lightning_muon.recipes.trust import saved_shapes

    shapes = saved_shapes(default_checkpoint)
    hparams = checked_checkpoint(default_checkpoint, DiTModule)
    extra = {**shapes, "model.extra.weight": (1,)}
    with pytest.raises(SizeMismatch, match="does not build model.extra.weight"):
        check_sizes(hparams, extra, "x")
    with pytest.raises(SizeMismatch, match="holds no model"):
        check_sizes(hparams, {}, "x")


@needs_mount
def test_a_full_disk_leaves_no_partial_file_and_the_old_one_intact(tmp_path):
    """A 1 MiB tmpfs. Too big by the tensors' bytes: refused before writing. Too big only by what the estimate does
    not count (a 2 MiB non-tensor entry): the disk fills mid-write. Either way one line naming the directory, needed
    and free bytes, no temporary, and the previous file loads. Control: torch.save leaves a truncated file."""
    with filesystem(tmp_path / "disk", pages=256) as disk:
        target = disk / "last.ckpt"
        atomic_save({"step": 1, "w": torch.ones(1000)}, target)
        with pytest.raises(StorageError, match=r"No space left in .*disk: last.ckpt needs 3.8 MiB, \d+.\d KiB free"):
            atomic_save({"w": torch.ones(1_000_000)}, target)
        with pytest.raises(StorageError, match="last.ckpt needs more than") as info:
            atomic_save({"w": torch.ones(1000), "blob": b"x" * (2 << 20)}, target)
        assert "\n" not in str(info.value)
        assert [p.name for p in disk.iterdir()] == ["last.ckpt"]  # no temporary left
        assert torch.load(target, weights_only=True)["step"] == 1
        with pytest.raises(RuntimeError):  # the control: torch's own save
            torch.save({"w": torch.ones(1_000_000)}, disk / "plain.ckpt")
        assert (disk / "plain.ckpt").is_file() and checkpoint_problem(disk / "plain.ckpt") is not None


def test_metrics_jsonl_keeps_one_row_per_step(tmp_path):
    """A run resumed from before an evaluation it had logged logs that step once (the newer row)."""
    path = tmp_path / "metrics.jsonl"
    for row in ({"step": 2, "v": 1}, {"step": 4, "v": 2}, {"step": 4, "v": 3}, {"step": 6, "v": 4}):
        append_jsonl(path, row)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 2, "v": 1},
        {"step": 4, "v": 3},
        {"step": 6, "v": 4},
    ]


@pytest.mark.slow  # 55 s on a 2-core machine; the default suite keeps the unit test of a full disk above
@needs_mount
def test_a_disk_filling_mid_checkpoint_loses_nothing_and_resume_is_exact(tmp_path):
    """The default fit with its checkpoint directory on a tmpfs that fills in the middle of the step-4 checkpoint:
    exit 1 with one line, step 2 intact, and rerunning with ``--ckpt_path DIR`` ends with exactly the uninterrupted
    run's weights (the matrix's ``full-mid-checkpoint`` row, with what is left on disk spelled out)."""
    matrix = Matrix(tmp_path)
    matrix.disk_full(1, "mid", "full mid-write", lambda r: r["checkpoint_pages"] - 8, "epoch=0-step=4.ckpt")
    (row,) = matrix.rows
    assert row["ok"], row
    assert row["exit"] == 1 and "epoch=0-step=4.ckpt needs more than" in row["message"]
    assert row["on_disk"] == "epoch=0-step=2.ckpt complete, last.ckpt complete, metrics.jsonl"
    assert row["resume"] == "exact"


@pytest.mark.slow
@needs_mount
def test_the_fault_matrix_passes_every_row(tmp_path):
    rows = Matrix(tmp_path).run_all()
    print(table(rows))
    assert len(rows) >= 18
    assert [r for r in rows if not r["ok"]] == []


def test_latent_shards_of_another_shape_are_refused_before_a_step(tmp_path):
    import lightning as L

    from lightning_muon.recipes.data import LatentShardsDataModule, write_latent_shard, write_manifest

    write_latent_shard(tmp_path / "a.safetensors", torch.randn(8, 4, 16, 16), labels=torch.arange(8) % 10)
    write_manifest(tmp_path)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = DiTModule(model_config={**TINY_DIT, "in_channels": 4, "sample_size": 8})
    with pytest.raises(ValueError, match=r"shape \(4, 16, 16\), but model_config expects \(4, 8, 8\)"):
        trainer.fit(module, LatentShardsDataModule(str(tmp_path), batch_size=4, num_workers=0))
    assert module.model is None  # refused before the network was built
    module = DiTModule(model_config={**TINY_DIT, "in_channels": 4, "sample_size": 16})  # the control: it trains
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, LatentShardsDataModule(str(tmp_path), batch_size=4, num_workers=0))
    assert trainer.global_step == 1
