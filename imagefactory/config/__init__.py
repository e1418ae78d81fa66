"""Step 2 of the package's layout, the matrix, checked and expanded (docs/architecture.md)."""
