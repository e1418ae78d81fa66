"""Step 9 of the package's layout, passing images -> pushed tags (docs/architecture.md)."""
