"""Step 5 of the package's layout, cells -> build contexts (docs/architecture.md)."""
