"""The OpenAI-compatible HTTP server (`jaxserve serve`)."""
