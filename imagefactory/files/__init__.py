"""Step 1 of the package's layout, reading and writing files (docs/architecture.md)."""
