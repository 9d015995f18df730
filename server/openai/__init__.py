"""OpenAI's completions and chat APIs (/v1/completions, /v1/chat/completions, /tokenize,
/detokenize): the request schemas, the serving of a request, and its response objects; the
chat messages, tools and route settings the other APIs share."""
