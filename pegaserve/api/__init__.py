"""The OpenAI-compatible HTTP layer: protocol models, validation, stop strings and the wire."""
