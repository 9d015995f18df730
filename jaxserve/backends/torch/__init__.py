"""The PyTorch/Triton backend (one device): the runner with CUDA graphs per bucket, its
sampler and fp8/int8 KV cache, under the same names as the JAX backend's modules. It never
imports jax or flax (tests/project/test_host_side_imports.py)."""
