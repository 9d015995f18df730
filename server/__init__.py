"""The front ends: the OpenAI-compatible HTTP server (`jaxserve serve`) and the gRPC service
beside it (vLLM's VllmEngine proto), both on the async engine.

This folder sits at the repository root and installs as `jaxserve.server` (pyproject's
package-dir): import it as `jaxserve.server`."""
