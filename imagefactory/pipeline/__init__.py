"""Step 10 of the package's layout, the steps run in order, cell by cell (docs/architecture.md)."""
