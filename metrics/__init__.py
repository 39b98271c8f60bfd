"""Generation-quality metrics (torchmetrics), their functional formulas and feature extractors."""
