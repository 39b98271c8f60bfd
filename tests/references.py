"""Independent float64 references the optimizer tests compare against (one of each)."""

import torch


def reference_ns(G, coefficients, safety=1.0, aol=False, eps=1e-7):
    """Textbook Newton–Schulz loop on one matrix in float64 (Keller Jordan's; modded-nanogpt's Polar Express form;
    AOL as in Turbo-Muon, unfused): wide orientation, X / max(s·‖X‖_F, eps), optional
    X ← diag(Σ_j |XXᵀ|_ij)^(-1/2) X / s, then X ← aX + (bA + cA²)X with A = XXᵀ recomputed every iteration."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (safety * X.norm()).clamp_min(eps)
    if aol:
        X = X / (X @ X.T).abs().sum(1).clamp_min(eps).sqrt()[:, None] / safety
    for a, b, c in coefficients:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def reference_batch(G, coefficients, **kwargs):
    """:func:`reference_ns` on every matrix of a ``(..., m, n)`` batch."""
    return torch.stack([reference_ns(g, coefficients, **kwargs) for g in G.reshape(-1, *G.shape[-2:])])
