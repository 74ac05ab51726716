"""Distributions, truncation and speculative acceptance (pure functions over mx arrays)."""
