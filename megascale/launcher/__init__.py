"""megascale.launcher."""
