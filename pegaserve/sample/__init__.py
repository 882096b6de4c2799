"""Sampling: logits processing, filters and the draw; structured outputs' grammars."""
