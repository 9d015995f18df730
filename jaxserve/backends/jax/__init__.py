"""The JAX backend: the runner (weights, paged KV cache, one compiled step per bucket), its
sampler, attention choice, fp8/int8 KV cache, bucket compilation and the executable cache,
weight placement and Orbax checkpoints, multi-host steps."""
