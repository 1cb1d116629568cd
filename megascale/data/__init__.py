"""megascale.data."""
