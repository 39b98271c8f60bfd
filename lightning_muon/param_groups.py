"""Split a DiT's parameters into Muon (2-D hidden weights) and AdamW (everything else) groups."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_muon.parallelize import BLOCK_PARAM_PATTERN

__all__ = [
    "EMBEDDER_PATTERN",
    "LAYER_TYPES",
    "check_param_coverage",
    "describe_param_groups",
    "muon_param_groups",
]

#: Layer types of a diffusers DiT block, usable as override keys: ``overrides={"attention": {"period": 2}}``.
LAYER_TYPES = {
    "attention": r"\.attn\d*\.",
    "feed_forward": r"\.ff\.",
    "modulation": r"\.norm1\.linear\.",
}
#: Conditioning embedders that diffusers nests inside blocks (``transformer_blocks.i.norm1.emb.*``) stay on AdamW.
EMBEDDER_PATTERN = r"(^|\.)(emb|embedder|embedding|embeddings|[a-z_]*_embedder|[a-z_]*_embedding)\."


def _default_use_muon(name: str, module: nn.Module, param: nn.Parameter) -> bool:
    """Muon for the weight of an ``nn.Linear`` inside a transformer block that is not a conditioning embedder."""
    return (
        isinstance(module, nn.Linear)
        and name.endswith(".weight")
        and param.ndim == 2
        and re.search(BLOCK_PARAM_PATTERN, name) is not None
        and re.search(EMBEDDER_PATTERN, name) is None
    )


def muon_param_groups(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    overrides: Sequence[tuple[str, Mapping[str, Any]]] | Mapping[str, Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Param groups for :class:`~lightning_muon.PeriodicRowwiseMuon` with named parameters.

    By default, the weight of every ``nn.Linear`` inside a transformer block (attention, feed-forward, adaLN
    modulation) goes to Muon; everything else (patch/position embeddings, timestep/class/caption embedders — also
    those diffusers nests in each block as ``norm1.emb`` —, the final modulation and output projection, biases, norm
    weights, PixArt's ``scale_shift_table``) goes to AdamW.

    Args:
        model: the network.
        muon: options for Muon groups (e.g. ``{"lr": 0.02}``).
        adamw: options for AdamW groups (e.g. ``{"lr": 3e-4, "weight_decay": 0.0}``).
        overrides: ``(regex, options)`` pairs matched with :func:`re.search` against parameter names (a key of
            :data:`LAYER_TYPES` — ``"attention"``, ``"feed_forward"``, ``"modulation"`` — stands for the Muon matrices
            of that layer type);
            ``options`` may set ``use_muon`` to move parameters between branches and any option of that branch, e.g.
            layer-wise ``period`` / ``rownorm_scale`` / ``schedule``. A parameter matched by two patterns, or a
            pattern that matches nothing, is an error.

    Returns:
        Groups of parameters with identical options, each with ``params``, ``param_names`` and ``use_muon``.
    """
    override_items = list(overrides.items() if isinstance(overrides, Mapping) else overrides)
    compiled = []
    for pattern, options in override_items:
        try:
            compiled.append((re.compile(LAYER_TYPES.get(pattern, pattern)), dict(options), pattern in LAYER_TYPES))
        except re.error as err:
            raise ValueError(f"Invalid override pattern {pattern!r}: {err}.") from err
    hits = {regex.pattern: 0 for regex, _, _ in compiled}
    modules = dict(model.named_modules())
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        default = _default_use_muon(name, module, param)
        matches = [
            (regex, options)
            for regex, options, matrices_only in compiled
            if regex.search(name) and (default or not matrices_only)
        ]
        if len(matches) > 1:
            raise ValueError(
                f"Parameter {name!r} matches several override patterns {[r.pattern for r, _ in matches]}; "
                "make the patterns disjoint."
            )
        options = dict(matches[0][1]) if matches else {}
        if matches:
            hits[matches[0][0].pattern] += 1
        use_muon = options.pop("use_muon", default)
        if use_muon and param.ndim != 2:
            raise ValueError(f"Override sends {name!r} with shape {tuple(param.shape)} to Muon, which needs 2-D.")
        options = {**dict((muon if use_muon else adamw) or {}), **options}
        key = (use_muon, tuple(sorted((k, repr(v)) for k, v in options.items())))
        group = groups.setdefault(key, {"params": [], "param_names": [], "use_muon": use_muon, **options})
        group["params"].append(param)
        group["param_names"].append(name)
    unused = [pattern for pattern, count in hits.items() if count == 0]
    if unused:
        raise ValueError(f"Override pattern(s) {unused} matched no parameter of {type(model).__name__}.")
    return sorted(groups.values(), key=lambda g: not g["use_muon"])


def check_param_coverage(model: nn.Module, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` unless every trainable parameter of ``model`` is in exactly one group."""
    seen: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"A parameter of shape {tuple(p.shape)} is in param groups {seen[id(p)]} and {g}.")
            seen[id(p)] = g
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameter(s) are in no param group: {missing[:5]}.")


def describe_param_groups(param_groups: Sequence[Mapping[str, Any]], model: nn.Module | None = None) -> str:
    """A plain-text table: one row per parameter with its group, branch, shape and lr, then totals per branch.

    With ``model`` the coverage is checked first (:func:`check_param_coverage`).
    """
    if model is not None:
        check_param_coverage(model, param_groups)
    rows = [("group", "branch", "lr", "shape", "numel", "parameter")]
    totals = {"muon": 0, "adamw": 0}
    for g, group in enumerate(param_groups):
        branch = "muon" if group.get("use_muon", True) else "adamw"
        names = group.get("param_names") or [f"<unnamed {i}>" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            totals[branch] += p.numel()
            shape = "x".join(map(str, p.shape))
            rows.append((str(g), branch, str(group.get("lr", "-")), shape, f"{p.numel():,}", name))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(totals.values()) or 1
    lines.append(
        f"muon: {totals['muon']:,} params ({100 * totals['muon'] / total:.1f}%), "
        f"adamw: {totals['adamw']:,} params ({100 * totals['adamw'] / total:.1f}%)"
    )
    return "\n".join(lines)
