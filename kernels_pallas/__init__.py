"""Attention kernels (Pallas) and their pure-JAX references."""
