"""Split a model's parameters into Muon (the hidden matrices) and AdamW (everything else) groups."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_muon.optim.matrices import MatrixLayout
from lightning_muon.parallelize import Blocks, find_blocks

__all__ = [
    "EMBEDDER_PATTERN",
    "LAYER_TYPES",
    "SELECT_RULES",
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


#: ``select`` rules of :func:`muon_param_groups`
SELECT_RULES = ("blocks", "hidden")


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer storing its weight as (in, out); found by name, so this
    package never imports transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _matrix_of(name: str, module: nn.Module, param: nn.Parameter) -> MatrixLayout | None:
    """The layout of a linear layer's weight (``nn.Linear``, transformers ``Conv1D``) or of 3-D expert weights
    (E > 1, out, in) held by a module that is no convolution; None for anything else."""
    weight = name.rpartition(".")[2] == "weight" and param.ndim == 2
    if weight and isinstance(module, nn.Linear):
        return MatrixLayout()
    if weight and _is_conv1d(module):
        return MatrixLayout(transposed=True)
    if param.ndim == 3 and param.shape[0] > 1 and not isinstance(module, nn.modules.conv._ConvNd):
        return MatrixLayout()  # (1, n, d) is a broadcast table (a position embedding), not experts
    return None


def _matrices(model: nn.Module, select: str, blocks: Blocks) -> tuple[dict[str, MatrixLayout], set[str]]:
    """Every matrix of the model with its layout, and the Muon matrices by the ``select`` rule: linear and expert
    weights inside blocks, or every hidden one (not the first nor the last linear layer of the model); conditioning
    embedders never."""
    if select not in SELECT_RULES:
        raise ValueError(f"select must be one of {SELECT_RULES}, got {select!r}.")
    modules = dict(model.named_modules())
    layouts = {}
    for name, param in model.named_parameters():
        layout = _matrix_of(name, modules[name.rpartition(".")[0]], param)
        if layout is not None:
            layouts[name] = layout
    if select == "hidden":
        linear = [n for n, p in model.named_parameters() if n in layouts and p.ndim == 2]
        chosen = set(layouts) - set(linear[:1] + linear[-1:])  # the input and output layers stay on AdamW
    else:
        inside = tuple(f"{b}." for b in find_blocks(model, blocks))
        chosen = {n for n in layouts if n.startswith(inside)}
    return layouts, {n for n in chosen if re.search(EMBEDDER_PATTERN, n) is None}


def _compile(
    patterns: Mapping[str, object] | Sequence[tuple[str, object]], what: str
) -> list[tuple[re.Pattern, object]]:
    items = list(patterns.items() if isinstance(patterns, Mapping) else patterns)
    compiled = []
    for pattern, value in items:
        try:
            compiled.append((re.compile(LAYER_TYPES.get(pattern, pattern)), value))
        except re.error as err:
            raise ValueError(f"Invalid {what} pattern {pattern!r}: {err}.") from err
    return compiled


def muon_param_groups(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    overrides: Sequence[tuple[str, Mapping[str, Any]]] | Mapping[str, Mapping[str, Any]] = (),
    blocks: Blocks = None,
    select: str = "blocks",
    pieces: Mapping[str, int] | None = None,
    require_muon: bool = True,
) -> list[dict[str, Any]]:
    r"""Param groups for :class:`~lightning_muon.PeriodicRowwiseMuon` with named parameters.

    The rule (``select="blocks"``): the weight of every linear layer inside a transformer block — ``nn.Linear``,
    transformers' ``Conv1D`` (its (in, out) storage handled: ``transposed``), 3-D expert weights (E, out, in) — goes
    to Muon; everything else (patch/position/token embeddings, timestep/class/caption embedders — also those
    diffusers nests in each block as ``norm1.emb`` —, the final modulation and output head, biases, norm weights,
    PixArt's ``scale_shift_table``) goes to AdamW. ``select="hidden"``: every linear layer's weight but the model's
    first and last (for networks without blocks, e.g. an MLP).

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
        blocks: what a transformer block is (:data:`~lightning_muon.parallelize.Blocks`: a name pattern, classes or
            class names, a predicate; ``None``: the repeated layers :func:`~lightning_muon.parallelize.find_blocks`
            finds).
        select: ``"blocks"`` or ``"hidden"`` (above).
        pieces: ``{regex: P}``: Muon weights whose output dimension stacks P equal matrices, each orthogonalized and
            row-normalized on its own — a fused QKV projection (``{r"\.c_attn\.": 3}``; per head: 3·heads).
        require_muon: raise when no parameter goes to Muon (``False``: an all-AdamW grouping is what you want).

    Returns:
        Groups of parameters with identical options, each with ``params``, ``param_names`` and ``use_muon`` (and
        ``transposed`` / ``pieces`` where a matrix's layout is not ``nn.Linear``'s).

    Raises:
        ValueError: no Muon parameter (with ``require_muon``), a pattern that matches nothing or a parameter matched
            twice, a weight that cannot be cut into its ``pieces``.
    """
    layouts, candidates = _matrices(model, select, blocks)
    compiled = [(r, dict(o), r.pattern in LAYER_TYPES.values()) for r, o in _compile(overrides, "override")]
    split = _compile(pieces or {}, "pieces")
    hits = {regex.pattern: 0 for regex, *_ in compiled + split}
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        default = name in candidates
        matches = [(regex, options) for regex, options, matrices_only in compiled
                   if regex.search(name) and (default or not matrices_only)]  # fmt: skip
        if len(matches) > 1:
            raise ValueError(
                f"Parameter {name!r} matches several override patterns {[r.pattern for r, _ in matches]}; "
                "make the patterns disjoint."
            )
        options = dict(matches[0][1]) if matches else {}
        if matches:
            hits[matches[0][0].pattern] += 1
        use_muon = options.pop("use_muon", default)
        if use_muon and param.ndim not in (2, 3):
            raise ValueError(
                f"Override sends {name!r} with shape {tuple(param.shape)} to Muon, which needs 2-D weights (or 3-D "
                "expert weights)."
            )
        if use_muon:
            options.update(_layout_options(name, param, layouts.get(name, MatrixLayout()), split, hits))
        options = {**dict((muon if use_muon else adamw) or {}), **options}
        key = (use_muon, tuple(sorted((k, repr(v)) for k, v in options.items())))
        group = groups.setdefault(key, {"params": [], "param_names": [], "use_muon": use_muon, **options})
        group["params"].append(param)
        group["param_names"].append(name)
    unused = [pattern for pattern, count in hits.items() if count == 0]
    if unused:
        raise ValueError(f"Pattern(s) {unused} matched no parameter of {type(model).__name__}.")
    if require_muon and not any(key[0] for key in groups):
        raise ValueError(
            f"No parameter of {type(model).__name__} goes to Muon: select={select!r} found no linear layer "
            f"{'inside a transformer block' if select == 'blocks' else 'between the first and the last'}. Say what "
            "a block is (blocks=a class, a class name or a name pattern), take every hidden linear layer "
            "(select='hidden'), send parameters to Muon by name (overrides={pattern: {'use_muon': True}}), or pass "
            "require_muon=False to train with AdamW only."
        )
    return sorted(groups.values(), key=lambda g: not g["use_muon"])


def _layout_options(
    name: str, param: nn.Parameter, layout: MatrixLayout, split: list[tuple[re.Pattern, object]], hits: dict
) -> dict[str, Any]:
    """A Muon parameter's layout options (only those that are not ``nn.Linear``'s), checked against its shape."""
    matched = [(regex, count) for regex, count in split if regex.search(name)]
    if len(matched) > 1:
        raise ValueError(f"Parameter {name!r} matches several pieces patterns {[r.pattern for r, _ in matched]}.")
    if matched:
        hits[matched[0][0].pattern] += 1
        layout = MatrixLayout(layout.transposed, matched[0][1])
    problem = layout.check(tuple(param.shape))
    if problem:
        raise ValueError(f"Muon parameter {name!r} {tuple(param.shape)} {problem}.")
    return ({"transposed": True} if layout.transposed else {}) | (
        {"pieces": layout.pieces} if layout.pieces > 1 else {}
    )


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
