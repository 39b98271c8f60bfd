"""Test helpers: tiny random-init diffusers models built from configs (nothing is downloaded)."""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_muon.parallelize import free_port


def tiny_dit(num_layers: int = 2, num_classes: int = 10, seed: int = 0):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=num_layers,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=num_classes,
    )


def tiny_pixart(num_layers: int = 2, seed: int = 0):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=num_layers,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
    )


#: A small class-conditional DiT on 8x8 one-channel digits (DiTModule(model_config=...)); TINY_DIT is smaller still.
SMALL_DIT = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=1,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)
TINY_DIT = {**SMALL_DIT, "attention_head_dim": 8, "num_layers": 1}


# ------------------------------------------------------------------------------------------- multi-process runs
def _distributed_entry(rank, fn, world_size, port, out_dir, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), f"{out_dir}/{rank}.pt")
        dist.barrier()  # no rank tears its process group down while another still talks to it
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size, *args):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo on 127.0.0.1); their results.

    The ranks are forked from the test process: they start with its modules imported (a spawned rank re-imports
    torch, Lightning and the package, most of a multi-process test's time on a 2-core machine) and run on one thread
    (intra-op threads are set before any work). ``fn`` must be importable (defined in this module or the library).
    """
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        args = (fn, world_size, free_port(), out_dir, args)
        mp.start_processes(_distributed_entry, args=args, nprocs=world_size, start_method="fork")
        return [torch.load(f"{out_dir}/{r}.pt", weights_only=False) for r in range(world_size)]


def digits_images(n: int, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    """The first ``n`` sklearn digits as uint8 images (n, 1, 8, 8), optionally with Gaussian pixel noise."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images[:n] / 16.0, dtype=torch.float32)[:, None]
    x = x + noise * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def metric_values(metrics, real, fake, batch_size):
    """Update each metric in batches with real and fake images, then compute; scalars as floats."""
    out = {}
    for name, metric in metrics.items():
        for i in range(0, len(real), batch_size):
            metric.update(real[i : i + batch_size], real=True)
        for i in range(0, len(fake), batch_size):
            metric.update(fake[i : i + batch_size], real=False)
        value = metric.compute()
        out.update(
            {f"{name}/{k}": float(v) for k, v in value.items()} if isinstance(value, dict) else {name: float(value)}
        )
    return out


def digits_metrics(classifier_path):
    from lightning_muon.metrics import (
        DigitsFeatures,
        FrechetDistance,
        MaximumMeanDiscrepancy,
        PrecisionRecallDensityCoverage,
    )

    features = DigitsFeatures(classifier_path)
    return {
        "fd": FrechetDistance(features),
        "prdc": PrecisionRecallDensityCoverage(features, k=5),
        "mmd": MaximumMeanDiscrepancy(features, sigma=1.0),
    }


def ddp_metric_worker(rank, world_size, classifier_path, n_real, n_fake):
    """Each rank sees the samples i ≡ rank (mod world size): uneven shards when sizes are not divisible."""
    real, fake = digits_images(n_real), digits_images(n_fake, noise=0.2)
    return metric_values(digits_metrics(classifier_path), real[rank::world_size], fake[rank::world_size], 16)


def tiny_text_encoder(path):
    """A random-init T5 encoder and a word-level tokenizer saved with save_pretrained (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "blue", "cat", "dog", "car", "two", "birds"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    ).save_pretrained(path)  # 512: what T5's own tokenizers declare
    torch.manual_seed(0)
    T5EncoderModel(
        T5Config(
            vocab_size=len(words), d_model=12, d_kv=4, num_heads=2, num_layers=1, d_ff=16, decoder_start_token_id=0
        )
    ).save_pretrained(path)


def tiny_vae(path, latent_channels: int = 4):
    """A random-init ``AutoencoderKL`` (downsampling 2x) saved with save_pretrained."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=16,
    ).save_pretrained(path)
    return path


def tiny_dinov2(path):
    """A random-init DINOv2 (hidden 32) saved with save_pretrained."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=14, image_size=56
    )
    Dinov2Model(config).save_pretrained(path)
    return path


def image_folder(root, n: int, size: int = 20, captions: list[str] | None = None, classes: int = 2):
    """``n`` small synthetic RGB images: a captions.jsonl folder (``captions`` cycled) or ``classes`` sub-folders."""
    import json

    from PIL import Image

    g = torch.Generator().manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        pixels = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
        if captions:
            Image.fromarray(pixels).save(root / f"{i}.png")
            lines.append(json.dumps({"file": f"{i}.png", "caption": captions[i % len(captions)]}))
        else:
            (root / f"c{i % classes}").mkdir(exist_ok=True)
            Image.fromarray(pixels).save(root / f"c{i % classes}" / f"{i}.png")
    if captions:
        (root / "captions.jsonl").write_text("\n".join(lines))
    return root


def all_metrics(classifier_path, clip_model=None, clip_path=None):
    """Every metric class on cheap extractors: the digits classifier (FD, PRDC, MMD, KID, IS on its features as
    logits) and, given a tiny CLIP, HPSv2."""
    from lightning_muon.metrics import HPSv2Score, InceptionScore, KernelInceptionDistance

    metrics = digits_metrics(classifier_path)
    features = metrics["fd"].extractor
    metrics["kid"] = KernelInceptionDistance(features, subsets=6, subset_size=20)
    metrics["is"] = InceptionScore(features, splits=4)
    if clip_path is not None:
        metrics["hps"] = HPSv2Score(clip_path, model_name=str(clip_model), batch_size=8)
    return metrics


def feed_and_compute(metrics, real, fake, prompts, batch_size=16, real_index=None, fake_index=None):
    """Update every metric of :func:`all_metrics` in batches (IS: generated only; HPS: images with prompts), with
    the samples' global indices when given."""
    real_index = torch.arange(len(real)) if real_index is None else real_index
    fake_index = torch.arange(len(fake)) if fake_index is None else fake_index
    out = {}
    for name, metric in metrics.items():
        for i in range(0, len(fake), batch_size):
            if name == "hps":
                metric.update(fake[i : i + batch_size].expand(-1, 3, -1, -1), prompts[i : i + batch_size])
            else:
                metric.update(fake[i : i + batch_size], real=False, index=fake_index[i : i + batch_size])
        if name not in ("hps", "is"):
            for i in range(0, len(real), batch_size):
                metric.update(real[i : i + batch_size], real=True, index=real_index[i : i + batch_size])
        value = metric.compute()
        out.update(
            {f"{name}/{k}": float(v) for k, v in value.items()} if isinstance(value, dict) else {name: float(value)}
        )
    return out


def ddp_empty_rank_worker(rank, world_size, classifier_path, clip_model, clip_path, empty_rank, n_real, n_fake):
    """Rank ``empty_rank`` never calls ``update``; the others share the samples round-robin."""
    real, fake = digits_images(n_real), digits_images(n_fake, noise=0.2)
    prompts = [("a cat", "a dog", "two birds")[i % 3] for i in range(n_fake)]
    busy = [r for r in range(world_size) if r != empty_rank]
    k, w = (busy.index(rank), len(busy)) if rank != empty_rank else (len(real) + len(fake), 1)  # k past the end
    real_index, fake_index = torch.arange(len(real))[k::w], torch.arange(len(fake))[k::w]
    real, fake, prompts = real[k::w], fake[k::w], prompts[k::w]
    metrics = all_metrics(classifier_path, clip_model, clip_path)
    return feed_and_compute(metrics, real, fake, prompts, real_index=real_index, fake_index=fake_index)


def ddp_reference_cache_worker(rank, world_size, classifier_path, cache_dirs, n_real, n_fake):
    """Each rank sees its own cache directory (node-local disks); rank 0's decides. Returns FD and PRDC values and
    whether this rank's extractor ran on real images."""
    from lightning_muon.metrics import ensure_references

    metrics = {k: v for k, v in digits_metrics(classifier_path).items() if k in ("fd", "prdc")}
    real, fake = digits_images(n_real), digits_images(n_fake, noise=0.2)
    calls = []
    extractor = metrics["fd"].extractor
    extractor.register_forward_hook(lambda *a: calls.append(1))
    paths = {name: f"{cache_dirs[rank]}/{name}.pt" for name in metrics}
    ensure_references(metrics, paths, lambda: [real[rank::world_size]], data={"images": "digits", "n": n_real})
    real_calls = len(calls)
    for m in metrics.values():
        m.update(fake[rank::world_size], real=False)
    values = {name: m.compute() for name, m in metrics.items()}
    return {"fd": float(values["fd"]), "recall": float(values["prdc"]["recall"]), "real_calls": real_calls}


def fork_ranks(fn, world_size: int, timeout: float, *args) -> list[dict]:
    """Fork ``world_size`` ranks with the environment torchrun gives its workers (Lightning and ``evaluate`` see an
    externally launched job), each running ``fn(rank, world_size, *args)`` with its output in a log file. Per rank:
    its exit ``code`` (1 for an exception, a ``SystemExit``'s code, ``"hung"`` when still running after ``timeout``
    seconds — then killed), the ``seconds`` from the start until it exited and its ``log``."""
    import os
    import signal
    import sys
    import tempfile
    import time
    import traceback

    port, start, pids = free_port(), time.time(), {}
    logs = tempfile.mkdtemp(prefix="ranks_")
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank
            log = open(f"{logs}/rank{rank}.log", "w", buffering=1)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = log  # pytest's capture replaced them; logging's handlers write here too
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", TORCHELASTIC_RUN_ID="test",
            )  # fmt: skip
            code = 0
            try:
                torch.set_num_threads(1)
                fn(rank, world_size, *args)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids[rank] = pid
    out: dict[int, dict] = {}
    while len(out) < world_size:
        for rank, pid in pids.items():
            if rank in out:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                out[rank] = {"code": os.waitstatus_to_exitcode(status), "seconds": time.time() - start}
            elif time.time() - start > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out[rank] = {"code": "hung", "seconds": time.time() - start}
        time.sleep(0.05)
    for rank in out:
        out[rank]["log"] = open(f"{logs}/rank{rank}.log").read()
    return [out[r] for r in range(world_size)]


def distributed_checkpoint(path: Path, extra: dict | None = None, meta: dict | None = None) -> Path:
    """A single-process torch.distributed.checkpoint directory with Lightning's ``meta.pt``."""
    dcp.save({"state_dict": {"w": torch.arange(6.0).view(2, 3)}, **(extra or {})}, checkpoint_id=path)
    torch.save(meta if meta is not None else {"global_step": 3}, path / "meta.pt")
    return path
