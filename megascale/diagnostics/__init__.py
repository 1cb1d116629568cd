"""megascale.diagnostics."""
