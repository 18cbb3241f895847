"""decode package."""
