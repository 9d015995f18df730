"""Attention kernels for the PyTorch backend: Triton kernels and their pure-PyTorch references.

ref.py is plain PyTorch (the CPU serving path, and the definition the kernels are tested
against, matching kernels_pallas/ref.py); attention.py and kv_write.py are Triton kernels that
run compiled on CUDA tensors or in Triton's interpreter on the host, chosen per call. Nothing
is imported here, so importing ref.py never needs Triton.

This folder sits at the repository root and installs as `jaxserve.kernels_triton`
(pyproject's package-dir): import it as `jaxserve.kernels_triton`."""
