"""Step 11 of the package's layout, beside the pipeline (docs/architecture.md)."""
