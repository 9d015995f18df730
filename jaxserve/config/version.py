"""The package version (pyproject.toml's), for the root package, /version and gRPC."""

VERSION = "0.1.0"
