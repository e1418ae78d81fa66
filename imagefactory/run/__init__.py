"""Step 8 of the package's layout, one run's settings (docs/architecture.md)."""
