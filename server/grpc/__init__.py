"""vLLM's VllmEngine gRPC service (from smg-grpc-proto): the server beside HTTP, the
servicer, and the translation of its messages."""
