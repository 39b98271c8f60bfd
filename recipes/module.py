"""``DiTModule``: a diffusers DiT / PixArt trained with rectified flow (or DDPM) and AdamW, Muon or Periodic Muon."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

import lightning_muon.device as device
from lightning_muon.callbacks.ema import EMA
from lightning_muon.callbacks.publish import log_on_logging_steps
from lightning_muon.optim import PeriodicRowwiseMuon
from lightning_muon.optim.config import MuonConfig, NonFinite
from lightning_muon.recipes.networks import (
    TINY_DIT,
    Architecture,
    PlainValue,
    PromptEncoder,
    build_transformer,
    cast,
    load_local,
    restore_initialization,
)
from lightning_muon.recipes.optimizers import OPTIMIZERS, LRSchedule, Optimizer, build_optimizer, lr_factor
from lightning_muon.recipes.trust import checked_checkpoint

__all__ = ["OPTIMIZERS", "DiTModule"]

# The choices of DiTModule's string options, as types: the CLI rejects a wrong value at parse time, naming it. The
# optimizer's come from lightning_muon.optim (one list each), the recipe's own are here.
Objective = Literal["flow", "ddpm"]
TimestepSampling = Literal["logit_normal", "uniform"]
FrozenDtype = Literal["auto", "bfloat16", "float32"]
OBJECTIVES = get_args(Objective)
FROZEN_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: DiTModule's flat optimizer options before they moved under ``muon``, and the MuonConfig field each became
LEGACY_MUON_KEYS = {
    **{k: k for k in ("lr", "momentum", "period", "rownorm_scale", "auto_scale_multiplier", "adjust_lr", "ns_dtype",
                      "ns_steps", "ns_coefficients", "ns_normalize", "ns_method", "drift_threshold", "min_period",
                      "max_period", "refresh_warmup")},
    "refresh_schedule": "schedule",
}  # fmt: skip


class DiTModule(L.LightningModule):
    """Class-conditional DiT or text-conditional PixArt with rectified flow (default) or DDPM ε-prediction.

    Flow: :math:`x_t = (1-t)x_0 + t\\varepsilon`, the network predicts :math:`v = \\varepsilon - x_0`, timestep
    ``1000·t``. DDPM: diffusers' ``DDPMScheduler.add_noise``, the network predicts ε. Labels (or caption embeddings)
    are replaced by the null condition with probability ``cfg_dropout`` for classifier-free guidance. An EMA copy of
    the weights (``ema_decay``) is what :meth:`generate` uses by default.

    Args:
        architecture: ``"dit"`` or ``"pixart"``.
        model_config: kwargs of the diffusers model (default: a ~2M-parameter DiT for 8×8 digits).
        num_classes: classes of a DiT (the null class is ``num_classes``).
        objective: ``"flow"`` or ``"ddpm"``.
        timestep_sampling: ``"logit_normal"`` or ``"uniform"`` (flow only).
        optimizer: ``"adamw"``, ``"muon"`` (K=1) or ``"periodic_muon"``.
        muon: the options of the Muon parameters, whole (:class:`~lightning_muon.optim.MuonConfig`: ``lr``, ``period``,
            ``rownorm_scale``, ``momentum``, the NS5 and refresh-schedule options; CLI ``--model.muon.period 3``); a
            dict of its fields works too. ``optimizer="muon"`` uses ``period=1``.
        adamw_lr: learning rate of the AdamW parameters (all of them for ``"adamw"``).
        adamw_weight_decay: decoupled weight decay of the AdamW parameters (Muon's is ``muon.weight_decay``).
        betas: AdamW's :math:`(\\beta_1, \\beta_2)`.
        param_overrides: layer-wise options of Muon groups, ``{pattern or layer type: options}`` for
            :func:`~lightning_muon.muon_param_groups` (e.g. ``{"attention": {"period": 2}, "feed_forward":
            {"period": 4}}``).
        warmup_steps: steps of linear learning-rate warm-up.
        schedule: ``"cosine"`` (to 0 at the last step), ``"constant"``, or ``"wsd"`` (warm-up, stable, then linear
            decay to 0 over the last ``decay_fraction`` of the steps; Hägele et al. 2024). Before its decay a WSD run
            *is* the constant run: a constant run checkpointed at step ``T − round(decay_fraction·T)`` and resumed
            as WSD with ``max_steps=T`` is the WSD run of ``T`` steps, so one constant run branches the whole
            quality-vs-budget frontier (``benchmarks/frontier_study.py``).
        decay_fraction: the WSD schedule's decay share of the steps, in (0, 1].
        ema_decay: EMA of the weights (0 disables it).
        cfg_dropout: condition dropout probability.
        noise_seed: seed of the training draws (noise, timesteps, condition dropout): step ``s`` on rank ``r`` draws
            from a generator seeded ``1,000,003·s + r + 2,654,435,761·noise_seed`` (a CPU generator keeps the low
            32 bits, which the golden-ratio multiplier spreads); 0 draws what runs drew before the option existed.
            Set it with the data order's seed for runs that differ in every draw (the validation loss keeps its
            fixed noise).
        vae_path: optional diffusers ``AutoencoderKL`` directory: train in its latent space.
        text_encoder_path: a transformers text encoder + tokenizer directory (T5 for PixArt): batches with
            ``"caption"`` strings and :meth:`generate` with prompts are encoded with it (frozen).
        max_caption_length: tokens per caption.
        val_timesteps: points of the fixed timestep grid of the validation loss.
        frozen_dtype: dtype of the frozen VAE and text encoder: ``"auto"`` (bf16 on CUDA, fp32 on CPU),
            ``"bfloat16"`` or ``"float32"``. They are replicated on every rank, outside FSDP and checkpoints.
        gradient_checkpointing: recompute each transformer block in backward (diffusers' activation
            checkpointing): activations drop from every block's intermediates to one input per block.
        nonfinite: what the optimizer does with a NaN/inf gradient: ``"skip"`` the step (on the device, counted in
            ``optim/nonfinite_skipped`` by ``OptimizerTelemetry``), ``"raise"`` or ``"ignore"``.
        predict_steps: sampler steps of ``lightning-muon predict`` (the datamodule's ``predict_dataloader`` yields
            the sample indices, e.g. ``DigitsDataModule(predict_samples=)``).
    """

    def __init__(
        self,
        architecture: Architecture = "dit",
        model_config: dict[str, PlainValue] | None = None,
        num_classes: int = 10,
        objective: Objective = "flow",
        timestep_sampling: TimestepSampling = "logit_normal",
        optimizer: Optimizer = "periodic_muon",
        muon: MuonConfig = MuonConfig(),
        adamw_lr: float = 1e-3,
        adamw_weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        param_overrides: dict[str, dict[str, PlainValue]] | None = None,
        warmup_steps: int = 0,
        schedule: LRSchedule = "cosine",
        decay_fraction: float = 0.2,
        ema_decay: float = 0.999,
        cfg_dropout: float = 0.1,
        noise_seed: int = 0,
        vae_path: str | None = None,
        text_encoder_path: str | None = None,
        max_caption_length: int = 120,
        val_timesteps: int = 8,
        frozen_dtype: FrozenDtype = "auto",
        gradient_checkpointing: bool = False,
        nonfinite: NonFinite = "skip",
        predict_steps: int = 25,
    ) -> None:
        super().__init__()
        for name, value, kind in (  # the CLI checks these types at parse time; a Python caller gets this
            ("optimizer", optimizer, Optimizer),
            ("objective", objective, Objective),
            ("timestep_sampling", timestep_sampling, TimestepSampling),
            ("schedule", schedule, LRSchedule),
            ("architecture", architecture, Architecture),
            ("nonfinite", nonfinite, NonFinite),
        ):
            if value not in get_args(kind):
                raise ValueError(f"{name} must be one of {get_args(kind)}, got {value!r}.")
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(
                f"decay_fraction (the WSD schedule's decay share of the steps) must be in (0, 1], got {decay_fraction}."
            )
        if not 0 <= noise_seed < 2**15:
            raise ValueError(f"noise_seed must be in [0, 32768), got {noise_seed}.")
        if not 0.0 <= cfg_dropout < 1.0 or not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"cfg_dropout and ema_decay must be in [0, 1), got {cfg_dropout} and {ema_decay}.")
        if frozen_dtype not in FROZEN_DTYPES:
            raise ValueError(f"frozen_dtype must be one of {sorted(FROZEN_DTYPES)}, got {frozen_dtype!r}.")
        muon = MuonConfig(**muon) if isinstance(muon, Mapping) else muon  # a checkpoint's hparams hold the dict
        self.save_hyperparameters(ignore=["muon"])
        self.hparams["muon"] = dataclasses.asdict(muon)  # plain data in checkpoints (weights_only loads it)
        # Every optimizer option is checked now, by the optimizer on stand-in parameters: a wrong value fails before
        # a Trainer or a model is built, with the optimizer's message naming it.
        options, adamw = self.optimizer_options()
        stand_in = [{"params": [torch.zeros(1, 1)]}, {"params": [torch.zeros(1)], "use_muon": False, **adamw}]
        PeriodicRowwiseMuon(stand_in, **options)
        self.model: nn.Module | None = None
        self.ema: nn.Module | None = None
        # Frozen models (VAE, text encoder) live in a plain dict, not as registered submodules: they are no FSDP
        # units, never in state_dict() or checkpoints (reloaded from their paths), never passed to the optimizer.
        self._frozen: dict[str, nn.Module] = {}

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> DiTModule:
        """Lightning's ``load_from_checkpoint``, after :func:`~lightning_muon.recipes.trust.checked_checkpoint` of a
        file given by path: nothing sized by the file is allocated before its sizes are those of its weights."""
        if isinstance(checkpoint_path, (str, os.PathLike)):  # checked, and in today's form (upgrade_hparams)
            kwargs = {**checked_checkpoint(checkpoint_path, cls), **kwargs}
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------- model
    @property
    def model_config(self) -> dict[str, PlainValue]:
        return dict(self.hparams.model_config or TINY_DIT)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)`` of the network's input: images, or latents with a VAE."""
        cfg = self.model_config
        return (int(cfg.get("in_channels", 4)), int(cfg.get("sample_size", 8)), int(cfg.get("sample_size", 8)))

    def setup(self, stage: str) -> None:
        """The per-sample shapes the training data declares (latent shards' headers) checked against the network's
        before anything is built or a step runs: a shard of another resolution or VAE is one line, not a shape error
        deep inside the first forward."""
        dataset = getattr(self._trainer.datamodule, "train_set", None) if self._trainer is not None else None
        latents = (getattr(dataset, "schema", None) or {}).get("latents")
        if latents is not None and tuple(latents["shape"]) != self.sample_shape:
            raise ValueError(
                f"The latent shards hold latents of shape {tuple(latents['shape'])}, but model_config expects "
                f"{self.sample_shape} (in_channels, sample_size, sample_size): encode them with this VAE and "
                "resolution, or set model_config to match."
            )

    def configure_model(self) -> None:
        """Build the network (and its EMA copy) once.

        Under a sharding strategy (a device mesh is set, e.g. ``muon_fsdp``) the transformer is built on the meta
        device: no rank ever holds the full model; the strategy shards it, materializes the shards and calls
        :meth:`on_materialized`.
        """
        if self.model is None:
            meta = self.device_mesh is not None
            with torch.device("meta") if meta else contextlib.nullcontext():
                self.model = build_transformer(self.hparams.architecture, self.model_config)
                if self.hparams.gradient_checkpointing:
                    self.model.enable_gradient_checkpointing()
                if self.hparams.ema_decay > 0:
                    self.ema = copy.deepcopy(self.model).requires_grad_(False)
        if self.hparams.vae_path and "vae" not in self._frozen:
            from diffusers import AutoencoderKL

            vae = load_local(AutoencoderKL, self.hparams.vae_path, "vae_path")
            self._frozen["vae"] = vae.eval().requires_grad_(False)
        if self.hparams.text_encoder_path and "text_encoder" not in self._frozen:
            encoder = PromptEncoder(self.hparams.text_encoder_path, self.hparams.max_caption_length)
            self._frozen["text_encoder"] = encoder

    def _frozen_model(self, name: str) -> nn.Module | None:
        """A frozen model on this module's device in ``frozen_dtype`` (moved on first use after a device change)."""
        model = self._frozen.get(name)
        if model is None:
            return None
        dtype = FROZEN_DTYPES[self.hparams.frozen_dtype] or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        p = next(model.parameters())
        if p.device != self.device or p.dtype != dtype:
            cast(model, device=self.device, dtype=dtype)
        return model

    @property
    def vae(self) -> nn.Module | None:
        """The frozen ``AutoencoderKL`` (``vae_path``), or None."""
        return self._frozen_model("vae")

    @property
    def text_encoder(self) -> PromptEncoder | None:
        """The frozen :class:`PromptEncoder` (``text_encoder_path``), or None."""
        return self._frozen_model("text_encoder")

    @torch.no_grad()
    def on_materialized(self) -> None:
        """After meta-device init: ``reset_parameters()`` re-initialized Linear / Conv / Norm / Embedding shards;
        this restores the rest — the sin-cos position embeddings and PixArt's ``scale_shift_table`` (randn / √d, as
        diffusers) — and copies the weights into the EMA."""
        restore_initialization(self.model)
        if self.ema is not None:
            for e, p in zip(self.ema.parameters(), self.model.parameters()):
                e.copy_(p)
            for e, b in zip(self.ema.buffers(), self.model.buffers()):
                e.copy_(b)

    def encode_prompts(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """Caption embeddings and mask of ``prompts`` (see :class:`PromptEncoder`)."""
        if self.text_encoder is None:
            raise ValueError("Prompts need a text encoder: set text_encoder_path (or pass caption_embeds).")
        return self.text_encoder(prompts)

    def _network(self, use_ema: bool) -> nn.Module:
        self.configure_model()
        return self.ema if use_ema and self.ema is not None else self.model

    def _forward(self, net: nn.Module, x: Tensor, timestep: Tensor, cond: dict[str, Tensor]) -> Tensor:
        if self.hparams.architecture == "dit":
            return net(x, timestep=timestep, class_labels=cond["labels"]).sample
        kwargs = {"resolution": None, "aspect_ratio": None}
        return net(
            x,
            encoder_hidden_states=cond["caption_embeds"],
            encoder_attention_mask=cond.get("caption_mask"),
            timestep=timestep,
            added_cond_kwargs=kwargs,
        ).sample

    def _null(self, cond: dict[str, Tensor]) -> dict[str, Tensor]:
        if "labels" in cond:
            return {"labels": torch.full_like(cond["labels"], self.hparams.num_classes)}
        return {k: torch.zeros_like(v) if k == "caption_embeds" else v for k, v in cond.items()}

    def _conditions(self, batch: dict[str, Any], drop: bool, generator: torch.Generator | None = None) -> dict:
        if self.hparams.architecture == "pixart" and "caption_embeds" not in batch:
            batch = {**batch, **self.encode_prompts(batch["caption"])}
        keys = ("labels",) if self.hparams.architecture == "dit" else ("caption_embeds", "caption_mask")
        cond = {k: batch[k] for k in keys if k in batch}
        if drop and self.hparams.cfg_dropout > 0:
            n = len(next(iter(cond.values())))
            mask = torch.rand(n, generator=generator, device=self.device) < self.hparams.cfg_dropout
            null = self._null(cond)
            cond = {k: torch.where(mask.view(-1, *[1] * (v.ndim - 1)), null[k], v) for k, v in cond.items()}
        return cond

    def _clean(self, batch: dict[str, Tensor]) -> Tensor:
        if "latents" in batch:
            return batch["latents"]
        x, vae = batch["images"], self.vae
        if vae is None:
            return x
        with torch.no_grad():
            return vae.encode(x.to(vae.dtype)).latent_dist.sample().float() * vae.config.scaling_factor

    # --------------------------------------------------------------------------------------------- objective
    def loss(self, net: nn.Module, x0: Tensor, cond: dict, t: Tensor, noise: Tensor) -> Tensor:
        """Per-batch loss at continuous times ``t`` in (0, 1) (flow) or their DDPM integer equivalents."""
        if self.hparams.objective == "flow":
            tt = t.view(-1, *[1] * (x0.ndim - 1))
            xt, target, timestep = (1 - tt) * x0 + tt * noise, noise - x0, t * 1000
        else:
            timestep = (t * 999).round().long()
            xt, target = self._ddpm().add_noise(x0, noise, timestep), noise
        return F.mse_loss(self._forward(net, xt, timestep, cond).float(), target.float())

    def _ddpm(self):
        from diffusers import DDPMScheduler

        if not hasattr(self, "_ddpm_scheduler"):  # x0 is clipped to [-1, 1] in pixel space, never in latent space
            self._ddpm_scheduler = DDPMScheduler(num_train_timesteps=1000, clip_sample=not self.hparams.vae_path)
        return self._ddpm_scheduler

    def _step_generator(self) -> torch.Generator:
        """Noise, timesteps and condition dropout of a training step come from a generator on the module's device
        seeded by (global step, rank), not from the global RNG: a resumed run draws exactly what the uninterrupted one
        drew, and the draws are made on the device (no pageable host-to-device copy stalling the CPU each step)."""
        rank = self.trainer.global_rank if self._trainer is not None else 0
        seed = 1_000_003 * self.global_step + rank + 2_654_435_761 * self.hparams.noise_seed
        return device.generator(self.device, seed)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        x0 = self._clean(batch)
        g = self._step_generator()
        cond = self._conditions(batch, drop=True, generator=g)
        noise = torch.randn(x0.shape, generator=g, device=self.device).to(x0.dtype)
        if self.hparams.timestep_sampling == "logit_normal" and self.hparams.objective == "flow":
            from diffusers.training_utils import compute_density_for_timestep_sampling

            # SD3's logit-normal: t = sigmoid(u), u ~ N(0, 1)
            t = compute_density_for_timestep_sampling(
                "logit_normal", len(x0), 0.0, 1.0, device=self.device, generator=g
            )
        else:
            t = torch.rand(len(x0), generator=g, device=self.device)
        loss = self.loss(self.model, x0, cond, t, noise)
        log_on_logging_steps(self, "train/loss", loss)  # the global batch's mean loss, every log_every_n_steps
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._fixed_grid_loss(batch, batch_idx), prog_bar=True, sync_dist=True)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._fixed_grid_loss(batch, batch_idx), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        """``{"index", "label", "image"}`` (uint8) for a batch of sample indices i (class ``i mod num_classes``,
        seed i), with the EMA weights;
        :class:`~lightning_muon.callbacks.SampleWriter` writes them as PNG files."""
        if self.hparams.architecture != "dit":
            raise ValueError("predict samples class-conditional models; for text-to-image use lightning-muon evaluate.")
        (indices,) = batch
        labels = indices % self.hparams.num_classes
        images = self.generate(labels, indices.tolist(), self.hparams.predict_steps)
        return {"index": indices, "label": labels, "image": images}

    def _fixed_grid_loss(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Deterministic loss: a fixed grid of timesteps, noise seeded by the batch index, no condition dropout."""
        x0 = self._clean(batch)
        cond = self._conditions(batch, drop=False)
        g = torch.Generator().manual_seed(batch_idx)
        noise = torch.randn(x0.shape, generator=g).to(x0)
        grid = (torch.arange(self.hparams.val_timesteps) + 0.5) / self.hparams.val_timesteps
        losses = [
            self.loss(self.model, x0, cond, torch.full((len(x0),), float(t), device=self.device), noise) for t in grid
        ]
        return torch.stack(losses).mean()

    def configure_callbacks(self) -> list[Callback]:
        """The EMA update (:class:`~lightning_muon.callbacks.EMA`, once per optimizer step) when ``ema_decay > 0``."""
        return [EMA(self.hparams.ema_decay)] if self.hparams.ema_decay > 0 else []

    # ------------------------------------------------------------------------------------------- optimizers
    def optimizer_options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(PeriodicRowwiseMuon options, AdamW group options)`` from the hyperparameters."""
        h = self.hparams
        adamw = {"lr": h.adamw_lr, "betas": tuple(h.betas), "weight_decay": h.adamw_weight_decay}
        muon = {**h.muon, "nonfinite": h.nonfinite}
        muon["period"] = 1 if h.optimizer == "muon" else muon["period"]
        return muon, adamw

    @classmethod
    def upgrade_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """Hyper-parameters (of a checkpoint or a config) written before the optimizer's options moved under
        ``muon``, in today's form: each flat key under ``muon`` (``refresh_schedule`` as ``schedule``), ``weight_decay``
        to both branches. Today's hyper-parameters pass unchanged."""
        out = {k: v for k, v in hparams.items() if k not in LEGACY_MUON_KEYS and k != "weight_decay"}
        old = {k: v for k, v in hparams.items() if k not in out}
        if not old:
            return out
        muon = dict(out.get("muon") or {})
        for key, value in old.items():
            if key == "weight_decay":
                out.setdefault("adamw_weight_decay", value)
            muon.setdefault(LEGACY_MUON_KEYS.get(key, key), value)
        out["muon"] = muon
        return out

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW, Muon (K=1) or Periodic Row-wise Muon on ``muon_param_groups``, warm-up + cosine/constant/WSD lr
        (:mod:`~lightning_muon.recipes.optimizers`)."""
        h = self.hparams
        muon, adamw = self.optimizer_options()
        opt = build_optimizer(self.model, h.optimizer, muon, adamw, h.param_overrides or {})
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1

        def factor(step: int) -> float:
            return lr_factor(step, total, h.warmup_steps, h.schedule, h.decay_fraction)

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        conditions: Sequence[int] | dict[str, Tensor],
        seeds: Sequence[int],
        num_inference_steps: int = 25,
        guidance_scale: float = 1.0,
        use_ema: bool = True,
        batch_size: int = 64,
    ) -> Tensor:
        """Sample images as uint8 ``(N, C, H, W)``. Sample i depends only on its condition and ``seeds[i]`` (its
        initial noise comes from its own generator), not on ``batch_size`` or the number of ranks.

        Args:
            conditions: class labels (DiT); prompts or ``{"caption_embeds": ..., "caption_mask": ...}`` (PixArt).
            seeds: one seed per sample.
            num_inference_steps: Euler (flow) or DDIM (DDPM) steps.
            guidance_scale: classifier-free guidance; 1 disables the unconditional pass.
            use_ema: sample with the EMA weights when there are any.
        """
        net = self._network(use_ema)
        if isinstance(conditions, dict):
            cond_all = conditions
        elif self.hparams.architecture == "pixart":
            cond_all = self.encode_prompts(conditions)
        else:
            cond_all = {"labels": torch.as_tensor(list(conditions))}
        if len(seeds) != len(next(iter(cond_all.values()))):
            raise ValueError("Pass exactly one seed per condition.")
        shape = self.sample_shape
        was_training = net.training
        net.eval()
        out = []
        for start in range(0, len(seeds), batch_size):
            idx = slice(start, start + batch_size)
            cond = {k: v[idx].to(self.device) for k, v in cond_all.items()}
            x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds[idx]])
            out.append(self._sample(net, x.to(self.device), cond, num_inference_steps, guidance_scale))
        net.train(was_training)
        return torch.cat(out)

    def _sample(self, net: nn.Module, x: Tensor, cond: dict, steps: int, guidance: float) -> Tensor:
        from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

        if self.hparams.objective == "flow":
            scheduler = FlowMatchEulerDiscreteScheduler()
        else:  # the training schedule's betas and clipping
            scheduler = DDIMScheduler.from_config(self._ddpm().config)
        scheduler.set_timesteps(steps, device=self.device)
        null = self._null(cond)
        for t in scheduler.timesteps:
            timestep = t.expand(len(x)).to(self.device)
            pred = self._forward(net, x, timestep, cond)
            if guidance != 1.0:
                pred_null = self._forward(net, x, timestep, null)
                pred = pred_null + guidance * (pred - pred_null)
            x = scheduler.step(pred, t, x).prev_sample
        if (vae := self.vae) is not None:
            x = vae.decode((x / vae.config.scaling_factor).to(vae.dtype)).sample.float()
        return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
