"""vLLM's stream interval: deliver a choice's tokens in messages of at least `num_tokens` tokens,
trading streaming granularity for fewer messages. A choice's first message (the time to first
token) and its finish are never held; anything held is released before a failure is reported."""

from __future__ import annotations

from pegaserve.messages import StepOutput


class StreamInterval:
    def __init__(self, num_tokens: int) -> None:
        assert num_tokens >= 1
        self.num_tokens = num_tokens
        self._held: dict[str, StepOutput] = {}
        self._started: set[str] = set()

    def push(self, output: StepOutput) -> StepOutput | None:
        """The message to deliver now for this output (None: held for more tokens)."""
        held = self._held.pop(output.request_id, None)
        merged = output if held is None else held.then(output)
        first = output.request_id not in self._started
        if first or merged.finish is not None or len(merged.tokens) >= self.num_tokens:
            self._started.add(output.request_id)
            if merged.finish is not None:
                self._started.discard(output.request_id)
            return merged
        self._held[output.request_id] = merged
        return None

    def flush(self) -> list[StepOutput]:
        """Everything held, at once (the stream is about to fail over or end)."""
        held, self._held = list(self._held.values()), {}
        return held
