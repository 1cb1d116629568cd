"""megascale.robustness."""
