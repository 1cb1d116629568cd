"""megascale.overlap."""
