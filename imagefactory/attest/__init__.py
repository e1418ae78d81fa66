"""Step 8 of the package's layout, what leaves with a passing image (docs/architecture.md)."""
