"""megascale.model."""
