"""Models this project did not write: transformers (Llama, GPT-2, BERT, ViT), timm, diffusers (DiT, PixArt, SD3), a
user-written MMDiT named as Black Forest Labs' reference code, a plain MLP — the split per model, a K=3 step, and
``muon_fsdp`` on 2 gloo ranks around a transformers Llama (the example users copy)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_dit, tiny_pixart
from torch import nn

from lightning_muon import PeriodicRowwiseMuon, find_blocks, muon_param_groups, shard_transformer
from lightning_muon.parallelize import free_port


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16))


def bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return BertModel(config)


def vit():
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64)  # fmt: skip
    return ViTModel(config)


def timm_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, embed_dim=32, num_heads=2)


def sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)  # fmt: skip


class DoubleBlock(nn.Module):
    """Flux's double-stream block, parameter names as in the reference code (``img_attn.qkv``, ``img_mod.lin``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        for stream in ("img", "txt"):
            self.add_module(f"{stream}_mod", nn.ModuleDict({"lin": nn.Linear(d, 6 * d)}))
            self.add_module(f"{stream}_attn", nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d)}))
            self.add_module(f"{stream}_mlp", nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))

    def forward(self, img, txt, vec):
        out = []
        for x, s in ((img, "img"), (txt, "txt")):
            shift, scale, *_ = getattr(self, f"{s}_mod")["lin"](vec).unsqueeze(1).chunk(6, -1)
            h = x * (1 + scale) + shift
            q, k, v = getattr(self, f"{s}_attn")["qkv"](h).chunk(3, -1)
            a = torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, -1) @ v
            out.append(x + getattr(self, f"{s}_attn")["proj"](a) + getattr(self, f"{s}_mlp")(h))
        return out


class SingleBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d, 7 * d), nn.Linear(5 * d, d)
        self.modulation = nn.ModuleDict({"lin": nn.Linear(d, 3 * d)})
        self.norm = nn.LayerNorm(d)

    def forward(self, x, vec):
        shift, scale, gate = self.modulation["lin"](vec).unsqueeze(1).chunk(3, -1)
        qkv, mlp = self.linear1(self.norm(x) * (1 + scale) + shift).split([3 * x.shape[-1], 4 * x.shape[-1]], -1)
        q, k, v = qkv.chunk(3, -1)
        a = torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, -1) @ v
        return x + gate * self.linear2(torch.cat([a, torch.relu(mlp)], -1))


class MMDiT(nn.Module):
    """A user's own MMDiT: ``double_blocks.i`` and ``single_blocks.i``, embedders and a final layer outside them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.img_in, self.txt_in = nn.Linear(4, d), nn.Linear(8, d)
        self.time_in = nn.ModuleDict({"in_layer": nn.Linear(1, d), "out_layer": nn.Linear(d, d)})
        self.double_blocks = nn.ModuleList([DoubleBlock(d) for _ in range(2)])
        self.single_blocks = nn.ModuleList([SingleBlock(d) for _ in range(2)])
        self.final_layer = nn.ModuleDict({"adaLN_modulation": nn.Linear(d, 2 * d), "linear": nn.Linear(d, 4)})

    def forward(self, img, txt, t):
        vec = self.time_in["out_layer"](torch.nn.functional.silu(self.time_in["in_layer"](t)))
        img, txt = self.img_in(img), self.txt_in(txt)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        x = torch.cat([txt, img], 1)
        for block in self.single_blocks:
            x = block(x, vec)
        shift, scale = self.final_layer["adaLN_modulation"](vec).unsqueeze(1).chunk(2, -1)
        return self.final_layer["linear"](x[:, txt.shape[1] :] * (1 + scale) + shift)


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def tokens():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def image(channels=3, size=16):
    return torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(0))


def dit_inputs(model):
    return {"hidden_states": image(4, 8), "timestep": torch.tensor([10, 500]), "class_labels": torch.tensor([1, 2])}


def pixart_inputs(model):
    no_resolution = {"resolution": None, "aspect_ratio": None}
    return {"hidden_states": image(4, 8), "encoder_hidden_states": torch.randn(2, 3, 12),
            "timestep": torch.tensor([1, 2]), "added_cond_kwargs": no_resolution}  # fmt: skip


def sd3_inputs(model):
    return {"hidden_states": image(4, 8), "encoder_hidden_states": torch.randn(2, 3, 16),
            "pooled_projections": torch.randn(2, 16), "timestep": torch.tensor([1, 2])}  # fmt: skip


def output(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return getattr(out, "logits", getattr(out, "last_hidden_state", getattr(out, "sample", out)))


#: model, inputs, (Muon, AdamW) parameter counts, and per model a few names checked on each side
MODELS = {
    "llama": (llama, lambda m: (tokens(),), (18432, 4256),
              ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"],
              ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"]),
    "gpt2": (gpt2, lambda m: (tokens(),), (24576, 3456),
             ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"],
             ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias"]),
    "bert": (bert, lambda m: (tokens(),), (16384, 20320),
             ["encoder.layer.0.attention.self.query.weight", "encoder.layer.1.output.dense.weight"],
             ["embeddings.word_embeddings.weight", "pooler.dense.weight", "encoder.layer.0.output.LayerNorm.weight"]),
    "vit": (vit, lambda m: (image(),), (16384, 3968),
            ["layers.0.attention.q_proj.weight", "layers.1.mlp.fc2.weight"],  # transformers 5 names
            ["embeddings.patch_embeddings.projection.weight", "embeddings.cls_token", "pooler.dense.weight"]),
    "mmdit": (MMDiT, lambda m: (torch.randn(2, 6, 4), torch.randn(2, 3, 8), torch.rand(2, 1)), (26112, 2516),
              ["double_blocks.0.img_attn.qkv.weight", "double_blocks.1.txt_mod.lin.weight",
               "single_blocks.0.linear1.weight", "single_blocks.1.modulation.lin.weight"],
              ["img_in.weight", "time_in.in_layer.weight", "final_layer.linear.weight", "single_blocks.0.norm.weight"]),
    "timm-vit": (timm_vit, lambda m: (image(3, 32),), (24576, 58696),
                 ["blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight"],
                 ["patch_embed.proj.weight", "pos_embed", "head.weight"]),
    "diffusers-dit": (tiny_dit, dit_inputs, (9216, 10688),
                      ["transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.1.norm1.linear.weight"],
                      ["transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight", "proj_out_2.weight"]),
    "diffusers-pixart": (tiny_pixart, pixart_inputs, (8192, 7952),
                         ["transformer_blocks.0.attn2.to_k.weight", "transformer_blocks.1.ff.net.2.weight"],
                         ["transformer_blocks.0.scale_shift_table", "caption_projection.linear_1.weight"]),
    "diffusers-sd3": (sd3, sd3_inputs, (15104, 7088),
                      ["transformer_blocks.0.attn.add_q_proj.weight",
                       "transformer_blocks.1.norm1_context.linear.weight"],
                      ["context_embedder.weight", "time_text_embed.timestep_embedder.linear_1.weight",
                       "proj_out.weight"]),
}  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_third_party_models_get_their_hidden_matrices_on_muon_and_train(name):
    build, inputs, counts, on_muon, on_adamw = MODELS[name]
    torch.manual_seed(0)
    model = build()
    groups = muon_param_groups(model, adamw={"lr": 1e-3})
    branch = {n: g["use_muon"] for g in groups for n in g["param_names"]}
    numel = dict(model.named_parameters())
    totals = tuple(sum(numel[n].numel() for n, m in branch.items() if m is side) for side in (True, False))
    assert totals == counts, totals
    assert all(branch[n] for n in on_muon) and not any(branch[n] for n in on_adamw)
    assert all(numel[n].ndim == 2 for n, m in branch.items() if m)
    transposed = {n for g in groups if g.get("transposed") for n in g["param_names"]}
    assert transposed == ({n for n in branch if branch[n]} if name == "gpt2" else set())  # every Conv1D, nothing else
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = PeriodicRowwiseMuon(groups, lr=0.02, period=3)
    losses = []
    for _ in range(4):  # refresh, RowNorm, RowNorm, refresh
        loss = output(model, inputs(model)).float().square().mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if branch[n] and n in on_muon)


def test_a_model_without_blocks_is_an_error_that_names_the_choices():
    with pytest.raises(ValueError, match=r"No parameter of Sequential goes to Muon.*blocks=.*select='hidden'.*"
                       r"require_muon=False"):  # fmt: skip
        muon_param_groups(mlp())
    groups = muon_param_groups(mlp(), select="hidden")  # every linear weight but the input and output layers
    assert [n for g in groups if g["use_muon"] for n in g["param_names"]] == ["2.weight"]
    assert all(not g["use_muon"] for g in muon_param_groups(mlp(), require_muon=False))


@pytest.mark.parametrize(
    ("blocks", "found"),
    [
        (None, ["model.layers.0", "model.layers.1"]),
        ("LlamaDecoderLayer", ["model.layers.0", "model.layers.1"]),
        (["LlamaDecoderLayer"], ["model.layers.0", "model.layers.1"]),
        (r"layers\.1$", ["model.layers.1"]),
        (lambda name, module: name == "model.layers.0", ["model.layers.0"]),
    ],
    ids=["found", "class-name", "class-names", "pattern", "predicate"],
)
def test_one_definition_of_a_block_serves_grouping_and_sharding(blocks, found):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = llama()
    blocks = [LlamaDecoderLayer] if blocks == ["LlamaDecoderLayer"] and found else blocks  # a class too
    assert list(find_blocks(model, blocks)) == found
    muon = {n for g in muon_param_groups(model, blocks=blocks) if g["use_muon"] for n in g["param_names"]}
    assert {re.match(r"model\.layers\.\d+", n).group() for n in muon} == set(found)


def test_blocks_found_inside_blocks_and_frozen_encoders_are_not_units():
    """Outermost blocks only; a frozen child (a text encoder) keeps its blocks out of the FSDP plan, an EMA copy of
    the trained model (same class, frozen) is sharded like it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from lightning_muon.parallelize import _frozen_children

    holder = nn.Module()
    holder.model, holder.ema, holder.text_encoder = llama(), llama().requires_grad_(False), bert().requires_grad_(False)
    assert _frozen_children(holder) == {"text_encoder"}
    assert "model.model.layers.0" in find_blocks(holder) and "model.model.layers.0.mlp" not in find_blocks(holder)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shard_transformer(holder, init_device_mesh("cpu", (1,)))
        units = {n for n, m in holder.named_modules() if isinstance(m, FSDPModule)}
    finally:
        dist.destroy_process_group()
    assert {"model.model.layers.0", "ema.model.layers.1", "model", "ema"} <= units
    assert not any(n.startswith("text_encoder") for n in units)


def test_bad_block_definitions_are_named():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        muon_param_groups(llama(), blocks="layers[")
    with pytest.raises(ValueError, match="blocks must be a regular expression, module classes"):
        find_blocks(llama(), [3])
    with pytest.raises(ValueError, match=r"No parameter of LlamaForCausalLM goes to Muon"):
        muon_param_groups(llama(), blocks="NoSuchLayer")


def test_fused_qkv_pieces_on_third_party_models():
    """timm's ``qkv`` and GPT-2's ``c_attn`` per projection, an MMDiT's per head (3 x 4 heads)."""
    groups = muon_param_groups(timm_vit(), pieces={r"\.qkv\.": 3})
    assert {n: g["pieces"] for g in groups if g.get("pieces") for n in g["param_names"]} == {
        "blocks.0.attn.qkv.weight": 3,
        "blocks.1.attn.qkv.weight": 3,
    }
    (fused,) = [g for g in muon_param_groups(gpt2(), pieces={r"c_attn": 3}) if g.get("pieces")]
    assert fused["transposed"] and fused["pieces"] == 3 and len(fused["params"]) == 2
    heads = [g for g in muon_param_groups(MMDiT(), pieces={r"_attn\.qkv": 12}) if g.get("pieces")]
    assert sum(len(g["params"]) for g in heads) == 4
    with pytest.raises(ValueError, match=r"matched no parameter"):
        muon_param_groups(llama(), pieces={r"qkv": 3})


EXAMPLE = Path(__file__).parents[2] / "examples" / "llama_muon_fsdp.py"


def fit_llama(tmp_path, name, devices, steps, batch_size=4, extra=()):
    record = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(EXAMPLE), "--devices", str(devices), "--max-steps", str(steps), "--batch-size",
           str(batch_size), "--root", str(tmp_path / name), "--record", str(record), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(record.read_text()), torch.load(record.with_suffix(".pt"), weights_only=True), proc.stdout


@pytest.mark.distributed
def test_a_transformers_llama_trains_under_muon_fsdp_sharded_equal_dense_and_resumes(tmp_path):
    """The documented example on 2 gloo ranks, stopped after its first epoch (4 steps) and resumed from the
    distributed checkpoint to 8: losses and final weights equal one uninterrupted process on the same global batch."""
    dense, dense_weights, _ = fit_llama(tmp_path, "dense", devices=1, steps=8, batch_size=8)
    first, _, stdout = fit_llama(
        tmp_path, "first", devices=2, steps=-1, extra=["--max-epochs", "1", "--blocks", "LlamaDecoderLayer"]
    )
    assert "muon: 18,432 params" in stdout
    ckpt = tmp_path / "first" / "ckpt" / "last.ckpt"
    assert ckpt.is_dir() and any(ckpt.glob("*.distcp"))
    # bounded by epochs as the first run: bounded by max_steps alone, the resumed run replays the restored epoch's
    # order for one batch only, then starts a new one (a resume issue of its own, noted; not this test's subject)
    bounds = ["--max-epochs", "2", "--ckpt-path", str(ckpt)]
    resumed, weights, _ = fit_llama(tmp_path, "resumed", devices=2, steps=-1, extra=bounds)
    assert [r["step"] for r in first + resumed] == list(range(1, 9))
    assert [r["loss"] for r in first + resumed] == pytest.approx([r["loss"] for r in dense], rel=1e-5)
    assert dense[-1]["loss"] < dense[0]["loss"]
    for n, w in weights.items():
        torch.testing.assert_close(w, dense_weights[n], rtol=1e-4, atol=1e-5)


def test_the_cli_takes_what_a_block_is(capsys, tmp_path, monkeypatch):
    """``--trainer.strategy.blocks`` reaches MuonFSDPStrategy as typed data (class names, never a class to import)."""
    from lightning_muon.recipes.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--print_config", "--trainer.strategy=lightning_muon.MuonFSDPStrategy",
            "--trainer.strategy.blocks=[LlamaDecoderLayer, GPT2Block]"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "blocks:\n      - LlamaDecoderLayer\n      - GPT2Block" in out


def test_expert_weights_go_to_muon_and_broadcast_tables_do_not():
    """A mixture-of-experts layer storing its experts as one (E, out, in) parameter, as transformers 5 does: one
    matrix per expert (tests/optim/test_matrices.py); a (1, n, d) table inside a block stays on AdamW."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.down_proj = nn.Parameter(torch.randn(4, 16, 8)), nn.Parameter(torch.randn(4, 8, 8))
            self.table = nn.Parameter(torch.zeros(1, 5, 8))

    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleDict({"mlp": Experts(), "attn": nn.Linear(8, 8)}) for _ in range(2)])
    branch = {n: g["use_muon"] for g in muon_param_groups(model) for n in g["param_names"]}
    assert branch["layers.0.mlp.gate_up_proj"] and branch["layers.1.mlp.down_proj"] and branch["layers.0.attn.weight"]
    assert not branch["layers.0.mlp.table"] and not branch["layers.0.attn.bias"]
