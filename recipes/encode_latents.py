"""Pre-encode an image folder into safetensors latent shards for ``LatentShardsDataModule``.

    python -m lightning_muon.recipes.encode_latents --images DIR --vae VAE_DIR [--text-encoder T5_DIR] --out DIR

Images (class sub-folders or ``captions.jsonl``) are resized and center-cropped to ``--image-size``, encoded with the
``AutoencoderKL`` (latent mean times its scaling factor) and, with a text encoder, their captions to
``caption_embeds`` / ``caption_mask``; otherwise class ``labels`` are stored. One shard per ``--shard-size`` images.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lightning_muon.recipes.data import ImageFolder, write_latent_shard
from lightning_muon.recipes.module import PromptEncoder, _load_local


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", required=True)
    parser.add_argument("--vae", required=True, help="diffusers AutoencoderKL directory")
    parser.add_argument("--text-encoder", default=None, help="transformers text encoder + tokenizer directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--max-caption-length", type=int, default=120)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from diffusers import AutoencoderKL
    from tqdm.auto import tqdm

    device = torch.device(args.device)
    vae = _load_local(AutoencoderKL, args.vae, "--vae").to(device).eval()
    text = PromptEncoder(args.text_encoder, args.max_caption_length).to(device) if args.text_encoder else None
    data = ImageFolder(args.images, args.image_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards, buffer = [], {}

    def flush() -> None:
        if buffer:
            path = out / f"shard_{len(shards):05d}.safetensors"
            write_latent_shard(path, **{k: torch.cat(v) for k, v in buffer.items()})
            shards.append(path)
            buffer.clear()

    with torch.no_grad():
        for batch in tqdm(DataLoader(data, batch_size=args.batch_size), desc="encoding", unit="batch"):
            latents = vae.encode(batch["images"].to(device)).latent_dist.mean * vae.config.scaling_factor
            parts = {"latents": latents.cpu()}
            if text is not None:
                parts.update({k: v.cpu() for k, v in text(batch["caption"]).items()})
            else:
                parts["labels"] = batch["labels"]
            for k, v in parts.items():
                buffer.setdefault(k, []).append(v)
            if sum(len(t) for t in buffer["latents"]) >= args.shard_size:
                flush()
    flush()
    print(f"wrote {len(shards)} shard(s) to {out}")
    return shards


if __name__ == "__main__":
    main()
