"""Configuration, host side: engine arguments and the frozen configs they resolve to, the
model folder and its generation defaults, the mesh and its sharding plan, KV-cache sizing,
the request limits table, speculative decoding's settings, and `jaxserve plan`.

Nothing here imports jax, flax or torch (tests/project/test_host_side_imports.py)."""
