"""The PyTorch models of the torch backend (installs as `jaxserve.models.torch`)."""
