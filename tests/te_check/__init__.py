"""TransformerEngine's own RoPE tests against `rope` (see README.md here). Nothing in this folder is
collected by the project's pytest (no file is named test_*.py)."""
