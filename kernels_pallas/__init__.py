"""Attention kernels (Pallas) and their pure-JAX references: ragged paged attention for the
TPU and the GPU, the XLA:CPU-tuned version, and the reference every one is tested against.

This folder sits at the repository root and installs as `jaxserve.kernels_pallas`
(pyproject's package-dir): import it as `jaxserve.kernels_pallas`."""
