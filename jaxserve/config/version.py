"""The package version, in one place: pyproject.toml reads it from here (setuptools' dynamic
version), and so do the root package, /version and gRPC."""

VERSION = "0.1.0"
