"""OpenAI's Responses API: the endpoint (run as a chat completion), its output view, the store, background responses."""
