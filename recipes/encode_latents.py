"""Pre-encode an image folder into safetensors latent shards for ``LatentShardsDataModule``.

    python -m lightning_muon.recipes.encode_latents --images DIR --vae VAE_DIR [--text-encoder T5_DIR] --out DIR
    torchrun --nproc-per-node 8 -m lightning_muon.recipes.encode_latents ...   # 8 GPUs, each encodes its shards

Images (class sub-folders or ``captions.jsonl``) are resized and center-cropped to ``--image-size``, encoded with the
``AutoencoderKL`` (latent mean times its scaling factor) and, with a text encoder, their captions to
``caption_embeds`` (stored in bf16) / ``caption_mask``; otherwise class ``labels`` are stored. ``--flip`` also stores
each image's horizontal mirror as its own sample (DiT's flip augmentation, done once at encoding time).

Sample j goes to shard ``j // --shard-size``; under torchrun, rank r encodes the shards k ≡ r (mod world size). Each
shard is written atomically; a rerun skips the shards that are already complete, so a killed encode resumes. The
``manifest.json`` that training requires is written last, by rank 0, once every shard exists.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from lightning_muon.recipes.data import ImageFolder
from lightning_muon.recipes.flags import option_names
from lightning_muon.recipes.latents import MANIFEST, read_safetensors_header, write_latent_shard, write_manifest
from lightning_muon.recipes.networks import PromptEncoder, load_local


def _complete(path: Path, rows: int) -> bool:
    """A shard from an earlier run that holds all its rows (shards are renamed into place whole)."""
    try:
        return all(v["shape"][0] == rows for v in read_safetensors_header(path)[1].values())
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_muon.recipes.encode_latents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--images", required=True, help="image folder (class sub-folders or captions.jsonl)")
    parser.add_argument("--vae", required=True, help="diffusers AutoencoderKL directory")
    parser.add_argument(
        *option_names("text_encoder"), default=None, help="transformers text encoder + tokenizer directory"
    )
    parser.add_argument("--out", required=True, help="latent directory to write (shards + manifest.json)")
    parser.add_argument(*option_names("image_size"), type=int, default=512)
    parser.add_argument(*option_names("max_caption_length"), type=int, default=120)
    parser.add_argument(*option_names("shard_size"), type=int, default=1000, help="samples per shard")
    parser.add_argument(*option_names("batch_size"), type=int, default=16)
    parser.add_argument("--flip", action="store_true", help="also store each image's horizontal mirror")
    parser.add_argument("--device", default=None, help="default: this rank's CUDA device, else cpu")
    args = parser.parse_args(argv)
    from diffusers import AutoencoderKL
    from tqdm.auto import tqdm

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (out / MANIFEST).unlink(missing_ok=True)  # the directory is complete again only when this run finishes
    data = ImageFolder(args.images, args.image_size)
    copies = 2 if args.flip else 1
    num_samples = copies * len(data)
    num_shards = -(-num_samples // args.shard_size)
    shards = [out / f"shard_{k:05d}.safetensors" for k in range(num_shards)]
    rows = [min(args.shard_size, num_samples - k * args.shard_size) for k in range(num_shards)]
    todo = [k for k in range(rank, num_shards, world) if not _complete(shards[k], rows[k])]

    vae = load_local(AutoencoderKL, args.vae, "--vae").to(device).eval() if todo else None
    text = PromptEncoder(args.text_encoder, args.max_caption_length).to(device) if todo and args.text_encoder else None
    for k in tqdm(todo, desc=f"encoding (rank {rank})", unit="shard", disable=not todo):
        samples = range(k * args.shard_size, k * args.shard_size + rows[k])
        images = sorted({j // copies for j in samples})
        parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for batch in DataLoader(Subset(data, images), batch_size=args.batch_size):
                if text is not None:
                    encoded = text(batch["caption"])
                    condition = {
                        "caption_embeds": encoded["caption_embeds"].to(torch.bfloat16).cpu(),
                        "caption_mask": encoded["caption_mask"].cpu(),
                    }
                else:
                    condition = {"labels": batch["labels"]}
                for x in [batch["images"], batch["images"].flip(-1)][:copies]:
                    latents = vae.encode(x.to(device)).latent_dist.mean * vae.config.scaling_factor
                    for name, value in {"latents": latents.float().cpu(), **condition}.items():
                        parts.setdefault(name, []).append(value)
        # views were appended per batch as [original, mirror]: put sample j = copies * image + view in order
        tensors = {}
        for name, chunks in parts.items():
            per_view = [torch.cat(chunks[v::copies]) for v in range(copies)]
            stacked = torch.stack(per_view, 1).flatten(0, 1)  # (images * copies, ...)
            offset = samples.start - images[0] * copies
            tensors[name] = stacked[offset : offset + rows[k]]
        write_latent_shard(shards[k], **tensors)

    if world > 1:
        dist.init_process_group("gloo")
        dist.barrier()  # every rank's shards are on disk
        dist.destroy_process_group()
    if rank == 0:
        missing = [s.name for s, n in zip(shards, rows) if not _complete(s, n)]
        if missing:
            raise RuntimeError(f"Shards {missing[:5]} are missing or incomplete; rerun to finish the encode.")
        write_manifest(out, shards)
        print(f"wrote {num_shards} shard(s), {num_samples} samples, and {MANIFEST} to {out}")
    return shards


if __name__ == "__main__":
    main()
