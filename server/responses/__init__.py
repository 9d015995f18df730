"""OpenAI's Responses API (/v1/responses): its schema, input items into chat messages,
truncation, the store of answers, and the output items and stream events."""
