"""A scripted LLM API on 127.0.0.1 for the SDK loopback tests: it speaks Anthropic's
``/v1/messages`` and OpenAI's ``/v1/chat/completions`` wire formats, answers each POST with the
next scripted response, and records every request (path, headers, JSON body). A ``STALL`` reply
accepts the request and never answers (until the server closes); a reply with ``drip_s`` sends its
headers at once, then its body one byte every ``drip_s`` seconds. With ``cache`` set to a
``PromptCache``, the server counts each request's input tokens itself and reports which were
written to and read from Anthropic's prompt cache, as the Messages API does."""

from __future__ import annotations

import hashlib
import json
import math
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # a dict is sent as JSON, a str as is
    headers: dict[str, str] = field(default_factory=dict)
    stall: bool = False  # read the request, send nothing
    drip_s: float | None = None  # send the body one byte every drip_s seconds


STALL = Reply(stall=True)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeLLM:
    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Seen] = []
        self.closing = threading.Event()
        self.cache: PromptCache | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                headers = {k.lower(): v for k, v in self.headers.items()}
                owner.requests.append(Seen(self.path, headers, body))
                reply = (
                    owner.replies.pop(0) if owner.replies else Reply(500, {"error": "unscripted"})
                )
                if reply.stall:
                    owner.closing.wait(60)
                    return
                if owner.cache is not None and isinstance(reply.body, dict):
                    reply.body["usage"] = {**reply.body["usage"], **owner.cache.usage(body)}
                data = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
                raw = data.encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if reply.drip_s is None:
                    self.wfile.write(raw)
                    return
                self.wfile.flush()
                for byte in raw:
                    if owner.closing.wait(reply.drip_s):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:  # the client hung up
                        return

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


class PromptCache:
    """Anthropic's prompt cache, modelled on the Messages API's documented behaviour.

    A request is a sequence of blocks: each tool, each system block, each message's content
    blocks. A block marked ``cache_control`` is a breakpoint: the prefix up to it is looked up —
    at the breakpoint and at up to ``lookback`` earlier block boundaries — and is stored when it
    is at least ``min_tokens`` long. The longest prefix found is read from the cache, the rest up
    to the last breakpoint is written to it, and what follows is plain input. Tokens are counted
    as a quarter of each block's JSON characters (the marks themselves are not counted)."""

    def __init__(self, min_tokens: int = 4096, lookback: int = 20) -> None:
        self.min_tokens = min_tokens
        self.lookback = lookback
        self.stored: set[str] = set()

    def usage(self, request: dict[str, Any]) -> dict[str, int]:
        blocks = _blocks(request)
        marks = [i for i, b in enumerate(blocks) if isinstance(b, dict) and "cache_control" in b]
        tokens, hashes, digest = [], [], hashlib.sha256(request.get("model", "").encode())
        for block in blocks:
            text = json.dumps(_unmarked(block), sort_keys=True)
            digest.update(text.encode())
            hashes.append(digest.copy().hexdigest())
            tokens.append(math.ceil(len(text) / 4))
        prefix = [sum(tokens[: i + 1]) for i in range(len(blocks))]
        read_end = -1
        for mark in marks:
            for i in range(mark, max(mark - self.lookback, -1), -1):
                if hashes[i] in self.stored:
                    read_end = max(read_end, i)
                    break
        last = marks[-1] if marks else -1
        for mark in marks:
            if prefix[mark] >= self.min_tokens:
                self.stored.add(hashes[mark])
        read = prefix[read_end] if read_end >= 0 else 0
        cached_to = prefix[last] if last >= 0 and prefix[last] >= self.min_tokens else read
        total = prefix[-1] if prefix else 0
        return {
            "input_tokens": total - max(cached_to, read),
            "cache_creation_input_tokens": max(cached_to - read, 0),
            "cache_read_input_tokens": read,
        }


def _blocks(request: dict[str, Any]) -> list[Any]:
    system = request.get("system", [])
    blocks: list[Any] = list(request.get("tools", []))
    blocks += [system] if isinstance(system, str) else system
    for message in request.get("messages", []):
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        blocks += [{"role": message["role"], **part} for part in parts]
    return blocks


def _unmarked(block: Any) -> Any:
    if isinstance(block, dict):
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Anthropic Messages API ------------------------------------------------------------------------
def anthropic_message(
    *blocks: dict[str, Any],
    stop: str = "tool_use",
    usage: tuple[int, int] = (120, 30),
    **extra: Any,
) -> Reply:
    return Reply(
        body={
            "id": "msg_test",
            "type": "message",
            "role": "assistant",
            "model": "claude-haiku-4-5",
            "content": list(blocks),
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
            **extra,
        }
    )


def anthropic_tool(call_id: str, name: str, args: dict[str, Any]) -> Reply:
    return anthropic_message(
        {"type": "text", "text": f"calling {name}"},
        {"type": "tool_use", "id": call_id, "name": name, "input": args},
    )


# -- OpenAI chat completions -----------------------------------------------------------------------
def openai_completion(
    *,
    calls: list[tuple[str, str, Any]] = (),
    content: str | None = None,
    refusal: str | None = None,
    finish: str = "tool_calls",
    usage: tuple[int, int] = (120, 30),
) -> Reply:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": refusal}
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for call_id, name, args in calls
        ]
    return Reply(
        body={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": "gpt-4.1-mini",
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": {
                "prompt_tokens": usage[0],
                "completion_tokens": usage[1],
                "total_tokens": sum(usage),
            },
        }
    )


def openai_tool(call_id: str, name: str, args: Any) -> Reply:
    return openai_completion(calls=[(call_id, name, args)])
