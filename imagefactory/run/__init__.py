"""Step 7 of the package's layout, one run's settings and its record (docs/architecture.md)."""
