"""The scheduling core, host side: requests and their sampling parameters, the KV block
manager with prefix caching, the scheduler and the step it hands a backend
(`scheduler_output.py`), the numpy step inputs, per-request token constraints, structured
outputs (grammar checks, the compile sandbox, llguidance matchers) and n-gram speculation.

Nothing here imports jax, flax or torch (tests/project/test_host_side_imports.py)."""
