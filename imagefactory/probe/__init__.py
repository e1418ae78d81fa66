"""Step 6 of the package's layout, an image -> verdicts (docs/architecture.md)."""
