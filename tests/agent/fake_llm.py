"""A scripted LLM API on 127.0.0.1 for the SDK loopback tests: it speaks Anthropic's
``/v1/messages`` and OpenAI's ``/v1/chat/completions`` wire formats, answers each POST with the
next scripted response, and records every request (path, headers, JSON body). A ``STALL`` reply
accepts the request and never answers (until the server closes)."""

from __future__ import annotations

import json
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
                data = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
                raw = data.encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

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
