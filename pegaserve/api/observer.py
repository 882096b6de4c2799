"""Hooks the serving path calls as a request progresses; the Ray edge turns them into metrics.

The default observer does nothing, so the API runs and is tested without any metrics backend.
"""

from __future__ import annotations

from pegaserve.stop import StopCause


class RequestObserver:
    def first_token(self, ttft_s: float) -> None:
        """The first token reached the client `ttft_s` after the request arrived."""

    def tokens(self, num_tokens: int, seconds_since_last: float) -> None:
        """`num_tokens` more tokens reached the client, `seconds_since_last` after the previous ones."""

    def finished(self, cause: StopCause, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        """The request ended (any cause, aborts and errors included)."""
