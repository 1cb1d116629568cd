"""megascale.parallel."""
