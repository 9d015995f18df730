"""The pooling APIs (/v1/embeddings, /pooling, /classify, /score, /rerank), as vLLM serves
them: the request schemas, the serving, and the response objects."""
