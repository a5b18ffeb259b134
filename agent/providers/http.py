"""HTTP failures of the LLM APIs as ``ProviderError``s that say what happened and what to change.

Shared by the Anthropic and OpenAI adapters: both SDKs raise a status error carrying the HTTP
status, the response headers and the server's message; this module decides which are worth
retrying and how to word them. ``sdk_errors`` translates either SDK's exceptions (both define the
same classes: ``APIResponseValidationError``, ``APIStatusError``, ``APIConnectionError``); the
adapters pass their SDK module, so no SDK type leaves them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from .base import ProviderError
from .retry import parse_retry_after


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

    The SDKs hand it to httpx, which applies it to connecting and to each wait for data: a server
    that accepts and never answers is dropped after this long.
    """
    if left_s is None:
        return configured_s
    return max(min(configured_s, left_s), 0.001)


def token_count(vendor: str, field: str, value: Any) -> int:
    """A token count the server reported, checked: a whole number ≥ 0, or ``malformed`` naming
    the field (a negative count would lower the run's total and defeat ``--max-tokens``)."""
    if type(value) is not int or value < 0:
        raise malformed(
            vendor,
            f"`{field}` is {value!r}, not a token count (a whole number ≥ 0); the turn is not "
            "counted — check that --base-url points at a server that reports usage correctly",
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
