"""Step 12 of the package's layout, what a run says (docs/architecture.md)."""
