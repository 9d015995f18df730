"""Request text in, host side: the tokenizer wrapper, chat templates rendered without turning
request text into special tokens, and JSON parsed with a depth bound.

Nothing here imports jax, flax or torch (tests/project/test_host_side_imports.py)."""
