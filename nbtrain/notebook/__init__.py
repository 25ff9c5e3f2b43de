"""The notebook side: runs in the kernel, in wings by concept (ARCHITECTURE.md; import-linter keeps their order)."""
