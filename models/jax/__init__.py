"""The Flax NNX models, one file per family (installs as `jaxserve.models.jax`)."""
