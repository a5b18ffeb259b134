"""Bounded retries with exponential backoff around ``Provider.complete``.

The SDK clients are built with their own retries off (``max_retries=0``) so that every wait is
decided here, announced to the user, and written to the transcript. Only errors a provider marks
``retryable`` (HTTP 429, 5xx and overloaded servers, dropped connections, timeouts) are retried;
a server that asks for a longer wait than the policy allows ends the run with a message saying so.
Every request and every wait fits in the run's remaining wall-clock time: a request gets that time
as its timeout, and when it runs out (before a request, or leaving no time for a retry) the
attempt ends with ``DeadlineExceeded``, which the loop reports as the run's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from .base import AssistantTurn, DeadlineExceeded, Provider, ProviderError, ToolSpec


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the n-th wait is ``base_delay_s · 2^(n-1)`` (at least the
    server's ``retry-after``), and no wait exceeds ``max_delay_s``."""

    attempts: int = 4
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, failures: int, retry_after: float | None) -> float:
        backoff = self.base_delay_s * 2 ** (failures - 1)
        return min(max(backoff, retry_after or 0.0), self.max_delay_s)


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds a server asks us to wait: ``retry-after-ms``, or ``retry-after`` as seconds or an
    HTTP date; ``None`` when it does not say."""
    if not headers:
        return None
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(float(millis) / 1000.0, 0.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


OnRetry = Callable[[int, float, ProviderError], None]


def complete_with_retries(
    provider: Provider,
    system: str,
    messages: list,
    tools: list[ToolSpec],
    policy: RetryPolicy,
    *,
    on_retry: OnRetry | None = None,
    time_left: Callable[[], float | None] = lambda: None,
    sleep: Callable[[float], None] = time.sleep,
) -> AssistantTurn:
    """``provider.complete`` with retries; raises the last ``ProviderError`` when they run out.

    ``on_retry(attempt, delay_s, error)`` is called before each wait; ``time_left()`` (seconds, or
    ``None`` for no limit) is each request's timeout, and stops retrying (``DeadlineExceeded``)
    when no time is left or the wait would outlast the run's wall-clock budget.
    """
    failures = 0
    while True:
        left = time_left()
        if left is not None and left <= 0:
            raise DeadlineExceeded("no time was left for a request")
        try:
            return provider.complete(system, messages, tools, timeout_s=left)
        except DeadlineExceeded:
            raise
        except ProviderError as e:
            failures += 1
            if not e.retryable:
                raise
            left = time_left()
            if left is not None and left <= 0:
                raise DeadlineExceeded(
                    f"the request was cut off when it ran out ({e.message})"
                ) from None
            if e.retry_after is not None and e.retry_after > policy.max_delay_s:
                raise ProviderError(
                    f"{e.message}; the server asks to wait {e.retry_after:.0f} s, longer than "
                    f"the {policy.max_delay_s:.0f} s this run waits — try again later "
                    "(`coda-agent synthesize --resume RUN_DIR` continues the run)",
                    kind=e.kind,
                ) from None
            if failures >= policy.attempts:
                raise ProviderError(
                    f"{e.message} (gave up after {failures} attempts)", kind=e.kind
                ) from None
            wait = policy.delay(failures, e.retry_after)
            if left is not None and wait >= left:
                raise DeadlineExceeded(
                    f"{e.message} (no retry: the run's time budget ends in {max(left, 0):.0f} s)"
                ) from None
            if on_retry is not None:
                on_retry(failures, wait, e)
            sleep(wait)
