"""Step 3 of the package's layout, cells -> lock files (docs/architecture.md)."""
