"""Step 4 of the package's layout, what talks to a container engine or a registry (docs/architecture.md)."""
