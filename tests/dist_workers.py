"""Functions run inside spawned gloo processes (importable by name, hence a module of their own)."""

import torch
from torch import nn

from lightning_muon import PeriodicRowwiseMuon

SHAPES = [(7, 5), (5, 7), (96, 64), (64, 96), (2, 64), (96, 64)]


def full_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def full_grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def optimizer_kwargs(period, mode, ns_dtype):
    return dict(lr=0.02, period=period, refresh=mode, ns_dtype=ns_dtype, weight_decay=0.01, bucket_mb=0.01)


def dense_run(shapes, period, mode, ns_dtype, steps=10, extra=None):
    params = [nn.Parameter(p) for p in full_params(shapes)]
    opt = PeriodicRowwiseMuon(params, **optimizer_kwargs(period, mode, ns_dtype), **(extra or {}))
    for grads in full_grads(shapes, steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def count_collectives(fn):
    """Run ``fn`` under the profiler; c10d collective counts by kind, independent of the optimizer's own counters."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {
        kind: sum(kind in n and "c10d" in n.lower() for n in names) for kind in ("allreduce", "allgather", "alltoall")
    }


def sharded_run(rank, world_size, shapes, cases, steps=10, mesh_shape=None):
    """For each (period, mode, ns_dtype): fully_shard the params, step on DTensor grads; full params, stats.

    ``mesh_shape=(replicas, shards)`` makes an HSDP mesh (Replicate on the first dimension, Shard(0) on the second).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = ("replicate", "shard") if mesh_shape else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape or (world_size,), mesh_dim_names=names)
    placements = [Replicate(), Shard(0)] if mesh_shape else [Shard(0)]
    results = []
    for period, mode, ns_dtype, *extra in cases:
        module = nn.Module()
        module.weights = nn.ParameterList([nn.Parameter(p) for p in full_params(shapes)])
        fully_shard(module, mesh=mesh)
        params = list(module.weights)
        opt = PeriodicRowwiseMuon(params, **optimizer_kwargs(period, mode, ns_dtype), **(extra[0] if extra else {}))
        per_step = []
        for grads in full_grads(shapes, steps):
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g, mesh, placements)
            counts = count_collectives(opt.step)
            per_step.append(
                {
                    "branches": dict(opt.last_branches),
                    "stats": opt.comm_stats(),
                    "profiled": counts,
                    "ns_flops": opt.last_ns_flops,
                }
            )
        results.append(
            {
                "params": [p.full_tensor() for p in params],
                "steps": per_step,
                "local_types": [type(opt.state[p]["momentum_buffer"]).__name__ for p in params],
                "placements": [str(p.placements) for p in params],
            }
        )
    return results


def placement_error_worker(rank, world_size):
    """A column-sharded (tensor-parallel style) matrix must be refused with a clear message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    p = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    p.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)])
    try:
        PeriodicRowwiseMuon([p]).step()
    except ValueError as err:
        return str(err)
    return "no error"


def generation_eval_worker(rank, world_size, classifier_path, cache_dir, num_samples):
    """Evaluate a fixed tiny DiT on digits metrics; every rank returns the synced values."""
    from lightning_muon.metrics import DigitsFeatures, FrechetDistance, PrecisionRecallDensityCoverage
    from lightning_muon.metrics.evaluation import Sampling, prepare_references, score_generation
    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    torch.manual_seed(0)
    from helpers import SMALL_DIT

    module = DiTModule(model_config=SMALL_DIT)
    module.configure_model()
    features = DigitsFeatures(classifier_path)
    metrics = {"fd_digits": FrechetDistance(features), "prdc_digits": PrecisionRecallDensityCoverage(features)}
    prepare_references(metrics, DigitsDataModule().real_images, cache_dir, "digits", 100)
    values, _, _ = score_generation(
        module, metrics, Sampling(num_samples, num_inference_steps=3, batch_size=16), progress=False
    )
    values.pop("eval/seconds")
    return values


NONFINITE_SHAPES = [(8, 16), (16, 8), (6,)]  # wide, tall, and a vector on AdamW


def nonfinite_run(params, opt, bad_step, place=lambda g: g, steps=4):
    """Step ``opt`` with seeded grads; at ``bad_step`` one element of the wide matrix's last row is NaN (under FSDP
    only the last rank holds it). Returns the skip count after each step, or the error message."""
    skipped = []
    for t, grads in enumerate(full_grads(NONFINITE_SHAPES, steps)):
        if t == bad_step:
            grads[0][-1, 3] = float("nan")
        for p, g in zip(params, grads):
            p.grad = place(g)
        try:
            opt.step()
        except FloatingPointError as err:
            return str(err)
        skipped.append(opt.nonfinite_steps_skipped)
    return skipped


def nonfinite_optimizer(params, period, mode, nonfinite):
    groups = [{"params": params[:2]}, {"params": params[2:], "use_muon": False}]
    return PeriodicRowwiseMuon(
        groups, period=period, refresh=mode, nonfinite=nonfinite, weight_decay=0.01, ns_dtype=torch.float32
    )


def nonfinite_dense(period, mode, nonfinite, bad_step):
    params = [nn.Parameter(p) for p in full_params(NONFINITE_SHAPES)]
    out = nonfinite_run(params, nonfinite_optimizer(params, period, mode, nonfinite), bad_step)
    return out, [p.detach() for p in params]


def nonfinite_consensus_worker(rank, world_size, period, mode, nonfinite, bad_step):
    """The same run on FSDP2 shards: every rank must take the same decision as the dense run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    module = nn.Module()
    module.weights = nn.ParameterList([nn.Parameter(p) for p in full_params(NONFINITE_SHAPES)])
    fully_shard(module, mesh=mesh)
    params = list(module.weights)
    opt = nonfinite_optimizer(params, period, mode, nonfinite)
    out = nonfinite_run(params, opt, bad_step, lambda g: distribute_tensor(g, mesh, [Shard(0)]))
    return out, [p.full_tensor() for p in params]


def meta_init_worker(rank, world_size):
    """DiTModule under a mesh builds on meta; after sharding + materialization + on_materialized nothing is left
    uninitialized: position embeddings equal a normal build's, PixArt tables have diffusers' scale."""
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_muon import shard_transformer
    from lightning_muon.recipes.module import DiTModule

    mesh = init_device_mesh("cpu", (world_size,))
    pixart = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
    )
    out = {}
    for arch, config in (("dit", None), ("pixart", pixart)):
        reference = DiTModule(architecture=arch, model_config=config)
        reference.configure_model()
        module = DiTModule(architecture=arch, model_config=config)
        module._device_mesh = mesh
        module.configure_model()
        was_meta = all(p.is_meta for p in module.model.parameters())
        shard_transformer(module, mesh)
        _materialize_distributed_module(module, torch.device("cpu"))
        module.on_materialized()
        tables = [p.full_tensor() for n, p in module.model.named_parameters() if n.endswith("scale_shift_table")]
        out[arch] = {
            "was_meta": was_meta,
            "pos_embed_equal": torch.equal(module.model.pos_embed.pos_embed, reference.model.pos_embed.pos_embed),
            "finite": all(torch.isfinite(p.full_tensor()).all() for p in module.model.parameters()),
            "table_std": [float(t.std() * t.shape[-1] ** 0.5) for t in tables],
            "ema_equal": all(
                torch.equal(e.full_tensor(), p.full_tensor())
                for e, p in zip(module.ema.parameters(), module.model.parameters())
            ),
        }
    return out


# ------------------------------------------------------------------------------------------- streamed latents
def latent_epoch_worker(rank, world_size, root, batch_size, steps, state, num_workers):
    """Iterate this rank's batches of one epoch of a latent directory through the real data module: ``steps``
    of them (all if None), starting from a saved loader ``state``; returns the sample ids seen (the ``index``
    tensor stored in the shards) and rank 0's loader state after them."""
    from lightning_muon.recipes.data import LatentShardsDataModule

    dm = LatentShardsDataModule(root, batch_size=batch_size, num_workers=num_workers)
    dm.setup()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(0)
    if state is not None:
        loader.load_state_dict(state)
    seen = []
    for i, batch in enumerate(loader):
        seen.append(batch["index"].tolist())
        if steps is not None and i + 1 == steps:
            break
    return {"seen": seen, "state": loader.state_dict()}


def geneval2_worker(rank, world_size, benchmark, judge, images, samples):
    """Rank 0 scores every image, the other ranks none (an empty rank); the reduced report on each rank."""
    from lightning_muon.metrics.geneval2 import GenEval2

    metric = GenEval2(benchmark, judge)
    if rank == 0:
        metric.update(images, samples)
    return {k: float(v) for k, v in metric.compute().items()}


#: (stored shape, layout options) of matrices that are not nn.Linear's: Conv1D weights (in, out) — tall, wide (its
#: RowNorm sums run over the sharded dim), square —, a fused weight in pieces, a Conv1D fused weight, experts
LAYOUT_PARAMS = [
    ((5, 7), {}),
    ((6, 10), {"transposed": True}),
    ((10, 6), {"transposed": True}),
    ((7, 7), {"transposed": True}),
    ((12, 4), {"pieces": 3}),
    ((4, 12), {"transposed": True, "pieces": 3}),
    ((3, 6, 4), {}),
    ((2, 3, 5), {"pieces": 3}),
]
LAYOUT_CASES = [
    ("gather", "fixed"),
    ("scatter", "fixed"),
    ("scatter", "auto"),
    ("gather", "adaptive"),
]


def _layout_groups(params, schedule):
    extra = {"rownorm_scale": "auto"} if schedule == "auto" else {}
    extra = {"schedule": "adaptive", "drift_threshold": 0.01} if schedule == "adaptive" else extra
    return [{"params": [p], **options, **extra} for p, (_, options) in zip(params, LAYOUT_PARAMS)]


def layout_dense_run(mode, schedule, steps=5):
    shapes = [s for s, _ in LAYOUT_PARAMS]
    params = [nn.Parameter(p) for p in full_params(shapes)]
    opt = PeriodicRowwiseMuon(_layout_groups(params, schedule), **optimizer_kwargs(3, mode, torch.float32))
    for grads in full_grads(shapes, steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def layout_sharded_run(rank, world_size, steps=5):
    """:func:`layout_dense_run` on FSDP2 shards (Shard(0) of the stored tensor) for every case: full params."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    shapes = [s for s, _ in LAYOUT_PARAMS]
    results = []
    for mode, schedule in LAYOUT_CASES:
        module = nn.Module()
        module.weights = nn.ParameterList([nn.Parameter(p) for p in full_params(shapes)])
        fully_shard(module, mesh=mesh)
        params = list(module.weights)
        opt = PeriodicRowwiseMuon(_layout_groups(params, schedule), **optimizer_kwargs(3, mode, torch.float32))
        for grads in full_grads(shapes, steps):
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            opt.step()
        results.append([p.full_tensor() for p in params])
    return results
