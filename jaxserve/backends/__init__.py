"""Where a step runs. This folder's own modules are host side: the runner protocol the engine
talks to (`protocol.py`), the one place a backend is chosen (`selection.py`), the
safetensors reader both backends load from (`checkpoint.py`) and the KV-cache formats
(`kv_formats.py`); they import neither jax nor torch.

Each backend has a folder with the same module names: `jax/` (the JAX/XLA runner on a mesh:
Flax models, Pallas kernels) and `torch/` (PyTorch and Triton on one device). Neither
imports the other; the engine imports a backend only when `selection.create_runner` builds
one."""
