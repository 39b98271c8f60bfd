"""muon_param_groups on real tiny diffusers DiT and PixArt models."""

import re

import pytest

from lightning_muon import PeriodicRowwiseMuon, check_param_coverage, describe_param_groups, muon_param_groups

DIT_MUON = {  # per block: adaLN-zero modulation, attention, feed-forward
    "norm1.linear.weight",
    "attn1.to_q.weight",
    "attn1.to_k.weight",
    "attn1.to_v.weight",
    "attn1.to_out.0.weight",
    "ff.net.0.proj.weight",
    "ff.net.2.weight",
}
PIXART_MUON = (DIT_MUON - {"norm1.linear.weight"}) | {n.replace("attn1", "attn2") for n in DIT_MUON if "attn1" in n}


def branch_of(groups):
    return {name: g["use_muon"] for g in groups for name in g["param_names"]}


def expected_muon(model, per_block):
    return {
        n
        for n, _ in model.named_parameters()
        if re.sub(r"^transformer_blocks\.\d+\.", "", n) in per_block and n.startswith("transformer_blocks.")
    }


def test_dit_grouping(dit):
    groups = muon_param_groups(dit)
    branch = branch_of(groups)
    assert set(branch) == {n for n, _ in dit.named_parameters()}
    assert {n for n, m in branch.items() if m} == expected_muon(dit, DIT_MUON)
    # the per-block conditioning embedders are AdamW even though their weights are 2-D Linear weights
    assert branch["transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight"] is False
    assert branch["transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight"] is False
    for name in (
        "pos_embed.proj.weight",
        "proj_out_1.weight",
        "proj_out_2.weight",
        "transformer_blocks.0.ff.net.2.bias",
    ):
        assert branch[name] is False
    check_param_coverage(dit, groups)
    PeriodicRowwiseMuon(groups)  # every Muon param is 2-D


def test_pixart_grouping(pixart):
    branch = branch_of(muon_param_groups(pixart))
    assert {n for n, m in branch.items() if m} == expected_muon(pixart, PIXART_MUON)
    for name in (
        "scale_shift_table",
        "transformer_blocks.0.scale_shift_table",
        "adaln_single.linear.weight",
        "caption_projection.linear_1.weight",
        "proj_out.weight",
    ):
        assert branch[name] is False


def test_options_and_overrides(dit):
    groups = muon_param_groups(
        dit,
        muon={"lr": 0.02},
        adamw={"lr": 1e-3},
        overrides=[(r"ff\.net\.2\.weight$", {"lr": 0.01}), (r"proj_out_1\.weight$", {"use_muon": True})],
    )
    by_name = {name: g for g in groups for name in g["param_names"]}
    assert by_name["transformer_blocks.0.ff.net.2.weight"]["lr"] == 0.01
    assert by_name["transformer_blocks.0.attn1.to_q.weight"]["lr"] == 0.02
    assert by_name["proj_out_1.weight"]["use_muon"] and by_name["proj_out_1.weight"]["lr"] == 0.02
    assert by_name["pos_embed.proj.bias"]["lr"] == 1e-3
    assert len(groups) == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([(r"nothing_matches", {"lr": 1.0})], "matched no parameter"),
        ([(r"attn1", {"lr": 1.0}), (r"to_q", {"lr": 2.0})], "matches several override patterns"),
        ([(r"pos_embed\.proj\.bias", {"use_muon": True})], "needs 2-D"),
        ([(r"(", {})], "Invalid override pattern"),
    ],
)
def test_bad_overrides(dit, overrides, message):
    with pytest.raises(ValueError, match=message):
        muon_param_groups(dit, overrides=overrides)


def test_coverage_errors_and_description(dit):
    groups = muon_param_groups(dit)
    text = describe_param_groups(groups, dit)
    assert "transformer_blocks.0.attn1.to_q.weight" in text and "muon:" in text and "adamw:" in text
    assert len(text.splitlines()) == 2 + sum(1 for _ in dit.parameters()) + 1
    missing = [dict(g, params=g["params"][1:], param_names=g["param_names"][1:]) for g in groups]
    with pytest.raises(ValueError, match="in no param group"):
        check_param_coverage(dit, missing)
    twice = groups + [{"params": [groups[0]["params"][0]], "param_names": ["again"]}]
    with pytest.raises(ValueError, match="is in param groups 0 and"):
        check_param_coverage(dit, twice)
    with pytest.raises(ValueError, match="more than one parameter group"):
        PeriodicRowwiseMuon(twice)
