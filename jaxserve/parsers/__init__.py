"""Model text out, host side: tool calls and reasoning ("thinking") parsed out of generated
text, vLLM's parsers by name.

Nothing here imports jax, flax or torch (tests/project/test_host_side_imports.py)."""
