"""Step 13 of the package's layout, the commands (docs/architecture.md)."""
