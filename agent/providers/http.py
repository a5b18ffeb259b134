"""HTTP failures of the LLM APIs as ``ProviderError``s that say what happened and what to change.

Shared by the Anthropic and OpenAI adapters: both SDKs raise a status error carrying the HTTP
status, the response headers and the server's message; this module decides which are worth
retrying and how to word them. ``sdk_errors`` translates either SDK's exceptions (both define the
same classes: ``APIResponseValidationError``, ``APIStatusError``, ``APIConnectionError``); the
adapters pass their SDK module, so no SDK type leaves them. ``call_within`` bounds a whole request
(httpx's own timeout bounds each wait for data, not the reply), and ``check_base_url`` refuses a
``--base-url`` no client could use before one is built.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .base import DeadlineExceeded, ProviderError
from .retry import parse_retry_after

T = TypeVar("T")

# The most tokens one request may report in a usage field: far past any model's context window,
# and small enough that every total and price computed from it stays an exact, finite number.
MAX_TOKEN_COUNT = 100_000_000


def server_detail(body: Any, fallback: str) -> str:
    """The server's own error message when its body has one (``{"error": {"message": ...}}``)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    if isinstance(body, str) and body.strip():
        return body.strip()[:300]
    return fallback


def status_error(
    vendor: str,
    status: int,
    detail: str,
    headers: Mapping[str, str] | None,
    *,
    key_var: str,
    model: str,
    base_url: str,
) -> ProviderError:
    """A ``ProviderError`` for an HTTP error ``status`` from ``vendor``'s API."""
    where = f"{vendor} API at {base_url}"
    if status == 429:
        return ProviderError(
            f"rate limited by the {where} (HTTP 429): {detail}",
            kind="rate_limit",
            retryable=True,
            retry_after=parse_retry_after(headers),
        )
    if status in (401, 403):
        return ProviderError(
            f"the {where} rejected the credentials (HTTP {status}): {detail} — check {key_var}",
            kind="auth",
        )
    if status == 404:
        return ProviderError(
            f"the {where} answered 404 Not Found for model {model!r}: {detail} — check --model "
            "(and --base-url, which should point at the API root)",
            kind="not_found",
        )
    if status in (408, 409) or status >= 500:
        return ProviderError(
            f"the {where} failed (HTTP {status}): {detail}",
            kind="server",
            retryable=True,
            retry_after=parse_retry_after(headers),
        )
    return ProviderError(
        f"the {where} rejected the request (HTTP {status}): {detail}", kind="bad_request"
    )


def request_timeout(configured_s: float, left_s: float | None) -> float:
    """One request's timeout: the configured one, cut to the run's remaining time when that is
    shorter (never zero: a request with no time left fails at once as a timeout).

    It bounds the whole request (``call_within``): connecting, sending, and reading the reply to
    its last byte, so a server that answers one byte at a time is cut off too. The SDKs also hand
    it to httpx, which applies it to each wait for data.
    """
    if left_s is None:
        return configured_s
    return max(min(configured_s, left_s), 0.001)


def call_within(
    limit_s: float,
    call: Callable[[], T],
    *,
    close: Callable[[], None],
    expired: Callable[[], Exception],
) -> T:
    """``call()``'s value; ``expired()`` is raised when it has not returned within ``limit_s``
    seconds.

    The call runs in a daemon thread while this one waits, so a reply that trickles in cannot
    hold the run past ``limit_s``. When time is up (or the wait is interrupted), ``close()``
    closes the client the call uses, which ends its connection; the thread is left to finish on
    its own, and whatever it returns or raises then is dropped. What ``call()`` raises in time is
    raised here.
    """
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="coda-provider-request", daemon=True).start()
    try:
        finished = done.wait(limit_s)
    except BaseException:
        close()
        raise
    if not finished:
        close()
        raise expired()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class SdkClient:
    """An SDK client made by ``make``, replaceable: ``replace()`` closes it — ending a request
    still in flight on it (``call_within``'s ``close``) — and makes a fresh one. ``client`` is the
    current one. A ``ValueError`` from ``make`` (the SDK's URL parser) is the ``config``
    ``ProviderError`` for ``where`` (the flag or variable the URL came from); ``example``: an
    API root to give instead."""

    def __init__(self, make: Callable[[], Any], *, where: str, base_url: str, example: str) -> None:
        self._make = make
        try:
            self.client = make()
        except ValueError as e:
            raise ProviderError(
                f"{where} {base_url!r} is not a usable URL ({e}); give the API root, such as "
                f"{example}",
                kind="config",
            ) from None

    def replace(self) -> None:
        old, self.client = self.client, self._make()
        old.close()


def out_of_time(
    vendor: str, base_url: str, limit_s: float, configured_s: float, left_s: float | None
) -> ProviderError:
    """The error for a request that got no whole reply within ``limit_s``: the run's deadline
    (``DeadlineExceeded``, a ``timeout`` stop) when the run's remaining time set the limit, else
    a retryable error for a request that outlasted the provider's own cap."""
    waited = f"the {vendor} API at {base_url} sent no whole reply in {limit_s:.1f} s"
    if left_s is not None and left_s <= configured_s:
        return DeadlineExceeded(f"the request was cut off when it ran out ({waited})")
    return ProviderError(
        f"{waited}, the longest one request may take — check that --base-url points at a "
        "server that answers, or give --timeout to end the run sooner",
        kind="network",
        retryable=True,
    )


def check_base_url(url: str, where: str = "--base-url") -> str:
    """``url`` if it is an ``http``/``https`` URL with a host; else a ``ProviderError`` (kind
    ``config``) saying what to give. ``where``: the flag or variable it came from."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port
    except ValueError as e:
        problem = f"it cannot be parsed ({e})"
    else:
        if parts.scheme not in ("http", "https"):
            problem = f"its scheme is {parts.scheme or 'missing'}, not http or https"
        elif not host:
            problem = "it names no host"
        else:
            return url
    raise ProviderError(
        f"{where} {url!r} is not a usable URL: {problem}; give the API root, such as "
        "https://api.anthropic.com or http://localhost:8000/v1",
        kind="config",
    )


def token_count(vendor: str, field: str, value: Any) -> int:
    """A token count the server reported, checked: a whole number from 0 to ``MAX_TOKEN_COUNT``,
    or ``malformed`` naming the field (a negative count would lower the run's total and defeat
    ``--max-tokens``; an absurd one would overflow the price)."""
    if type(value) is not int or not 0 <= value <= MAX_TOKEN_COUNT:
        shown = repr(value)
        if len(shown) > 24:
            unit = "digits" if type(value) is int else "characters"
            shown = f"{shown[:12]}… ({len(shown)} {unit})"
        raise malformed(
            vendor,
            f"`{field}` is {shown}, not a token count (a whole number from 0 to "
            f"{MAX_TOKEN_COUNT:,}); the turn is not counted — check that --base-url points at a "
            "server that reports usage correctly",
        )
    return value


def unreachable(vendor: str, base_url: str, cause: str) -> ProviderError:
    return ProviderError(
        f"cannot reach the {vendor} API at {base_url} ({cause}) — check the network, and that "
        "--base-url points at a running server",
        kind="network",
        retryable=True,
    )


def malformed(vendor: str, what: str) -> ProviderError:
    return ProviderError(
        f"the {vendor} API returned a malformed response: {what}", kind="malformed"
    )


@contextmanager
def sdk_errors(
    sdk: ModuleType, vendor: str, *, key_var: str, model: str, base_url: str
) -> Iterator[None]:
    """Turn an SDK call's failures into ``ProviderError``s (``sdk``: the ``anthropic`` or
    ``openai`` module)."""
    try:
        yield
    except sdk.APIResponseValidationError as e:
        raise malformed(vendor, str(e)) from None
    except sdk.APIStatusError as e:
        detail = server_detail(e.body, e.message)
        raise status_error(
            vendor,
            e.status_code,
            detail,
            e.response.headers,
            key_var=key_var,
            model=model,
            base_url=base_url,
        ) from None
    except sdk.APIConnectionError as e:
        raise unreachable(vendor, base_url, str(e)) from None
    except json.JSONDecodeError as e:
        raise malformed(vendor, f"the body is not JSON ({e.msg})") from None
    except RecursionError:
        raise malformed(vendor, "the body's JSON is nested too deeply to read") from None
    except ValueError as e:  # what JSON parsing refuses beyond syntax (a number too long)
        raise malformed(vendor, f"the body's JSON cannot be read ({_first_line(e)})") from None


def _first_line(error: Exception) -> str:
    """An exception's message up to its first ';' or line break (Python's advice after it is
    for programmers)."""
    text = str(error).split(";")[0].strip()
    return text.splitlines()[0] if text else type(error).__name__
