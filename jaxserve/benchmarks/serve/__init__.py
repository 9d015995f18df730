"""`jaxserve bench serve` (vLLM's `vllm bench serve`): the datasets, the client that sends
them to a running server, and the report."""
