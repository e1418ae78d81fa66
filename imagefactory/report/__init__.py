"""Step 7 of the package's layout, what a run says (docs/architecture.md)."""
