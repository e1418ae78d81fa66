"""Step 10 of the package's layout, passing images -> pushed tags (docs/architecture.md)."""
