"""megascale.train."""
