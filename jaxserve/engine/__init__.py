"""The engine, host side: `LLMEngine` (admission, step, outputs), the admission path every
front end uses (`admission.py`), data-parallel replicas, the stats snapshot other threads
read, the detokenizer and the `RequestOutput` types with their processor.

Nothing here imports jax, flax or torch at import time: a backend is built through
`backends.selection` (tests/project/test_host_side_imports.py)."""
