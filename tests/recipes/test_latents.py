"""Streamed latent shards: manifest checks, exact row reads, every sample once per epoch, resume on another world
size, and the distributed / resumable encode_latents."""

import json

import pytest
import torch
from dist_workers import latent_epoch_worker
from helpers import run_distributed

from lightning_muon.recipes.data import LatentShardsDataModule, write_latent_shard, write_manifest
from lightning_muon.recipes.latents import MANIFEST, GlobalBatchSampler, LatentShards


def latent_dir(root, sizes=(7, 5, 9), caption=True):
    """Shards of the given sizes; sample i carries ``index`` = i, so reads can be checked row by row."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    start, rows = 0, []
    for k, n in enumerate(sizes):
        tensors = {"latents": torch.randn(n, 4, 2, 2, generator=g), "index": torch.arange(start, start + n)}
        if caption:
            tensors["caption_embeds"] = torch.randn(n, 3, 6, generator=g).to(torch.bfloat16)
            tensors["caption_mask"] = torch.ones(n, 3, dtype=torch.long)
        write_latent_shard(root / f"shard_{k:05d}.safetensors", **tensors)
        rows.append(tensors)
        start += n
    write_manifest(root)
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def test_rows_are_read_exactly_and_bf16_embeds_come_back_as_float32(tmp_path):
    full = latent_dir(tmp_path)
    data = LatentShards(tmp_path)
    ids = [20, 0, 6, 7, 13, 11]
    batch = data[ids]
    assert torch.equal(batch["index"], torch.tensor(ids)) and torch.equal(batch["latents"], full["latents"][ids])
    assert batch["caption_embeds"].dtype == torch.float32
    assert torch.equal(batch["caption_embeds"], full["caption_embeds"][ids].float())
    with pytest.raises(IndexError):
        data[[21]]


def test_incomplete_or_inconsistent_directories_are_refused(tmp_path):
    latent_dir(tmp_path / "ok")
    (tmp_path / "ok" / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json .3 shard.*encode_latents"):
        LatentShardsDataModule(str(tmp_path / "ok")).setup()
    latent_dir(tmp_path / "bad")
    write_latent_shard(tmp_path / "bad" / "shard_00001.safetensors", torch.randn(5, 4, 3, 3), index=torch.arange(5))
    with pytest.raises(ValueError, match=r"shard_00001.safetensors does not match"):
        LatentShards(tmp_path / "bad")
    with pytest.raises(ValueError, match="schema"):
        write_manifest(tmp_path / "bad")
    (tmp_path / "bad" / "shard_00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard_00001.safetensors listed in"):
        LatentShards(tmp_path / "bad")


@pytest.mark.parametrize(("n", "batch", "world"), [(21, 2, 1), (21, 4, 1), (20, 5, 1), (8, 8, 1)])
def test_every_sample_once_per_epoch_with_equal_step_counts(n, batch, world):
    sampler = GlobalBatchSampler(torch.arange(n), batch)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        steps = list(sampler)
        assert len(steps) == len(sampler) == n // batch
        assert sorted(i for s in steps for i in s) == list(range(n))
        assert all(len(s) == batch for s in steps[:-1]) and batch <= len(steps[-1]) < 2 * batch
    sampler.set_epoch(0)
    assert list(sampler) != steps  # a new permutation each epoch


@pytest.mark.distributed
@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_resume_on_three_ranks_after_two_sees_every_sample_exactly_once(tmp_path, num_workers):
    latent_dir(tmp_path, sizes=(13, 17, 11, 9), caption=False)  # 50 samples
    first = run_distributed(latent_epoch_worker, 2, str(tmp_path), 3, 4, None, num_workers)  # 4 steps x 6
    state = first[0]["state"]
    rest = run_distributed(latent_epoch_worker, 3, str(tmp_path), 3, None, state, num_workers)
    seen = [i for r in first + rest for step in r["seen"] for i in step]
    assert len(seen) == 50 and sorted(seen) == list(range(50))
    steps = {len(r["seen"]) for r in rest}
    assert steps == {(50 - 24) // 9}  # every rank the same number of steps; the last also takes the remainder


def test_encode_latents_flips_resumes_and_writes_the_manifest_last(tmp_path):
    from diffusers import AutoencoderKL
    from helpers import image_folder, tiny_vae

    from lightning_muon.metrics.images import ImageFolder
    from lightning_muon.recipes.encode_latents import main as encode

    images = image_folder(tmp_path / "images", 5, size=16, classes=2)
    vae = tiny_vae(tmp_path / "vae")
    args = [
        "--images",
        str(images),
        "--vae",
        str(vae),
        "--out",
        str(tmp_path / "lat"),
        "--image-size",
        "16",
        "--shard-size",
        "4",
        "--flip",
        "--device",
        "cpu",
    ]
    shards = encode(args)
    data = LatentShards(tmp_path / "lat")
    assert len(shards) == 3 and len(data) == 10
    folder = ImageFolder(images, 16)
    model = AutoencoderKL.from_pretrained(vae).eval()
    with torch.no_grad():
        x = folder[3]["images"][None]
        want = torch.cat([model.encode(v).latent_dist.mean for v in (x, x.flip(-1))]) * model.config.scaling_factor
    torch.testing.assert_close(data[[6, 7]]["latents"], want, rtol=1e-5, atol=1e-6)  # image 3, then its mirror
    assert torch.equal(data[[6, 7]]["labels"], torch.tensor([folder.labels[3]] * 2))

    # a killed encode: one shard and the manifest gone; the rerun re-encodes only that shard
    mtimes = {s.name: s.stat().st_mtime_ns for s in shards}
    shards[1].unlink()
    (tmp_path / "lat" / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="manifest"):
        LatentShards(tmp_path / "lat")
    encode(args)
    assert {s.name: s.stat().st_mtime_ns for s in shards if s != shards[1]} == {
        k: v for k, v in mtimes.items() if k != shards[1].name
    }
    assert json.loads((tmp_path / "lat" / MANIFEST).read_text())["num_samples"] == 10
    torch.testing.assert_close(LatentShards(tmp_path / "lat")[[6, 7]]["latents"], want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- untrusted shards
def raw_shard(path, header, data=b""):
    """A file laid out as safetensors (8-byte little-endian header length, JSON header, data) from any header."""
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


def good_header(rows=3):
    latents = rows * 4 * 4  # float32 (rows, 4)
    return {
        "latents": {"dtype": "F32", "shape": [rows, 4], "data_offsets": [0, latents]},
        "labels": {"dtype": "I64", "shape": [rows], "data_offsets": [latents, latents + rows * 8]},
    }, rows * 24


def safetensors_refuses(path):
    """The reference: the safetensors library's own reader (it validates a file before returning a tensor)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:
        return True
    return False


def malformed(name):
    """One malformed shard per way a header can lie about its file (reproduced on the old reader)."""
    header, size = good_header()
    if name == "truncated":
        return header, bytes(size - 40)
    if name == "huge_row":  # 1 GiB per row in a 100-byte file
        header["latents"] = {"dtype": "F32", "shape": [3, 2**28], "data_offsets": [0, 3 * 2**30]}
        return header, bytes(100)
    if name == "shape_2_60":
        header["latents"]["shape"] = [3, 2**60]
    if name == "past_the_end":
        header["labels"]["data_offsets"] = [size, size + 24]
    if name == "overlapping":  # labels decoded from latent bytes
        header["labels"]["data_offsets"] = [0, 24]
    if name == "short_span":
        header["latents"]["data_offsets"] = [0, 40]
    if name == "unknown_dtype":
        header["labels"]["dtype"] = "Q8"
    if name == "negative_dim":
        header["labels"]["shape"] = [-3]
    if name == "not_an_object":
        header = [1, 2]
    return header, bytes(size)


MALFORMED = [
    "truncated",
    "huge_row",
    "shape_2_60",
    "past_the_end",
    "overlapping",
    "short_span",
    "unknown_dtype",
    "negative_dim",
    "not_an_object",
]


def test_a_well_formed_raw_shard_is_read_by_us_and_by_safetensors(tmp_path):
    """The control of the malformed cases: the same construction with an honest header is accepted by both."""
    header, size = good_header()
    path = raw_shard(tmp_path / "a.safetensors", header, bytes(size))
    assert not safetensors_refuses(path)
    write_manifest(tmp_path)
    batch = LatentShards(tmp_path)[[0, 2]]
    assert batch["latents"].shape == (2, 4) and torch.equal(batch["labels"], torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_shards_are_refused_before_training_naming_the_file(tmp_path, case):
    header, data = malformed(case)
    path = raw_shard(tmp_path / "a.safetensors", header, data)
    assert safetensors_refuses(path), "the reference accepts this file: the case tests nothing"
    with pytest.raises(ValueError, match="a.safetensors"):
        write_manifest(tmp_path)
    # a manifest written while the shard was whole, then the shard replaced: refused at construction (setup)
    good, size = good_header()
    raw_shard(path, good, bytes(size))
    write_manifest(tmp_path)
    raw_shard(path, header, data)
    with pytest.raises(ValueError, match="a.safetensors"):
        LatentShardsDataModule(str(tmp_path)).setup()


def test_a_shard_truncated_after_setup_raises_on_read(tmp_path):
    full = latent_dir(tmp_path, sizes=(4,), caption=False)
    data = LatentShards(tmp_path)
    assert torch.equal(data[[3]]["latents"], full["latents"][[3]])  # control: the whole file reads
    path = tmp_path / "shard_00000.safetensors"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(OSError, match="shard_00000.safetensors ended inside row"):
        data[[3]]


def test_why_rows_are_not_read_through_safetensors_lazy_slices(tmp_path):
    """``safe_open(...).get_slice`` reads through a memory map: a shard truncated while a run reads it kills the
    reading process with SIGBUS (exit 135, no message), where our reads raise the OSError above. Should safetensors
    ever raise instead, this fails, and the rows can go through its slices."""
    import signal
    import subprocess
    import sys

    from safetensors.torch import save_file

    path = tmp_path / "shard.safetensors"
    save_file({"latents": torch.randn(1000, 4, 16, 16)}, str(path))  # 4 MB: row 900 lies pages past the cut
    code = (
        "import os; from safetensors import safe_open\n"
        f"with safe_open({str(path)!r}, 'pt') as f:\n"
        "    rows = f.get_slice('latents')\n"
        f"    os.truncate({str(path)!r}, 100_000)\n"
        "    float(rows[900:901].sum())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode in (-signal.SIGBUS, 128 + signal.SIGBUS), (proc.returncode, proc.stderr[-500:])


@pytest.mark.parametrize(
    "entry", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/a.safetensors", "..", 7, None]
)
def test_manifest_entries_outside_the_folder_are_refused(tmp_path, entry):
    latent_dir(tmp_path / "data", sizes=(3,), caption=False)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((tmp_path / "data" / "shard_00000.safetensors").read_bytes())
    manifest = json.loads((tmp_path / "data" / MANIFEST).read_text())
    assert len(LatentShards(tmp_path / "data")) == 3  # control: the honest manifest loads
    manifest["shards"][0]["file"] = entry
    (tmp_path / "data" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="file name inside"):
        LatentShards(tmp_path / "data")
