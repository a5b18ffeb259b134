"""The real ``anthropic`` and ``openai`` SDK clients against a scripted server on 127.0.0.1.

End to end: a broken program, its Report as the tool result, the fix, ``finish`` — asserting what
the loop sent (system prompt, tool schema, tool results) and what it counted. Then the failures a
live API produces: 429 then success, 5xx, an unreachable server, a malformed body, a rejected or
missing key, a refusal, a server that never answers (the run's --timeout bounds the request),
impossible token counts, a 10 MB reply. No network is used.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from coda.agent.clipping import MAX_PART_CHARS
from coda.agent.loop import Budgets
from coda.agent.providers import ProviderError, Usage, make_provider
from coda.agent.providers.anthropic import AnthropicProvider
from coda.agent.providers.http import MAX_TOKEN_COUNT
from coda.agent.providers.openai import OpenAIProvider
from coda.agent.providers.retry import RetryPolicy
from coda.agent.synthesize import synthesize
from coda.agent.transcript import RunState, read_transcript
from coda.planner import lower_partial
from coda.primitives import Program
from tests.planner.mystery_block import MIXED

from .fake_llm import (
    STALL,
    FakeLLM,
    PromptCache,
    Reply,
    anthropic_message,
    anthropic_tool,
    closed_port,
    openai_completion,
    openai_tool,
)
from .scripted import BLOCK, FAST, broken_program, good_program

QUICK_RETRY = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.05)


@pytest.fixture
def server() -> Iterator[FakeLLM]:
    fake = FakeLLM()
    yield fake
    fake.close()


def anthropic_at(url: str) -> AnthropicProvider:
    return AnthropicProvider("claude-haiku-4-5", base_url=url, api_key="sk-ant-test")


def openai_at(url: str) -> OpenAIProvider:
    return OpenAIProvider("gpt-4.1-mini", base_url=f"{url}/v1", api_key="sk-oai-test")


VENDORS = {
    "anthropic": (anthropic_at, anthropic_tool, "/v1/messages"),
    "openai": (openai_at, openai_tool, "/v1/chat/completions"),
}


def run(provider: Any, tmp_path: Path, budgets: Budgets | None = None):  # noqa: ANN201
    return synthesize(
        BLOCK, tmp_path, provider=provider, sandbox=FAST, retry=QUICK_RETRY, budgets=budgets
    )


def check_submit_schema(schema: dict[str, Any]) -> None:
    """The tool's input is {"program": <a JSON object>}: the Program's fields are in the system
    prompt, not sent a second time in the tool schema."""
    assert schema["type"] == "object" and schema["required"] == ["program"]
    assert schema["properties"]["program"]["type"] == "object"
    assert "$defs" not in schema and len(json.dumps(schema)) < 300


def breakpoints(body: dict[str, Any]) -> list[str]:
    """Where a Messages-API request asks for caching: "tool i", "system", "message i"."""
    marks = [f"tool {i}" for i, t in enumerate(body["tools"]) if "cache_control" in t]
    marks += ["system" for b in body["system"] if "cache_control" in b]
    for i, message in enumerate(body["messages"]):
        if any("cache_control" in block for block in message["content"]):
            assert "cache_control" in message["content"][-1]  # on its last block
            marks.append(f"message {i}")
    return marks


def test_anthropic_sdk_end_to_end(server: FakeLLM, tmp_path: Path) -> None:
    server.replies = [
        anthropic_tool("toolu_1", "submit_program", {"program": broken_program()}),
        anthropic_tool("toolu_2", "submit_program", {"program": good_program()}),
        anthropic_tool("toolu_3", "finish", {"reason": "verified"}),
    ]
    result = run(anthropic_at(server.url), tmp_path)
    assert result.verified and result.stop.kind == "finished" and result.turns == 3
    assert (result.usage.input_tokens, result.usage.output_tokens) == (360, 90)
    assert result.cost_usd == pytest.approx((360 * 1.0 + 90 * 5.0) / 1e6)

    first, second = (r.body for r in server.requests[:2])
    assert all(r.path == "/v1/messages" for r in server.requests)
    assert server.requests[0].headers.get("x-api-key") == "sk-ant-test" or (
        server.requests[0].headers.get("authorization") == "Bearer sk-ant-test"
    )
    assert first["model"] == "claude-haiku-4-5" and first["max_tokens"] > 0
    (system,) = first["system"]
    assert system["text"].startswith("You are a GPU kernel engineer")
    assert [t["name"] for t in first["tools"]] == ["submit_program", "describe_primitive", "finish"]
    check_submit_schema(first["tools"][0]["input_schema"])
    assert "def llama_mlp(" in first["messages"][0]["content"][0]["text"]
    # turn 2 carries turn 1 and the Report, as a tool_result for toolu_1
    user, assistant, results = second["messages"]
    assert assistant["role"] == "assistant" and assistant["content"][1]["type"] == "tool_use"
    assert assistant["content"][1]["input"]["program"] == broken_program()
    (answer,) = results["content"]
    assert answer["type"] == "tool_result" and answer["tool_use_id"] == "toolu_1"
    assert "FAILED at semantics" in answer["content"] and answer["is_error"] is False
    # caching: the tools, the system prompt and the newest user messages are breakpoints
    assert breakpoints(first) == ["tool 2", "system", "message 0"]
    assert breakpoints(second) == ["tool 2", "system", "message 0", "message 2"]
    third = server.requests[2].body
    assert breakpoints(third) == ["tool 2", "system", "message 2", "message 4"]
    assert all(b["cache_control"] == {"type": "ephemeral"} for b in [*first["tools"][2:], system])


def test_openai_sdk_end_to_end(server: FakeLLM, tmp_path: Path) -> None:
    server.replies = [
        openai_tool("call_1", "submit_program", {"program": broken_program()}),
        openai_tool("call_2", "submit_program", "{this is not json"),
        openai_tool("call_3", "submit_program", {"program": good_program()}),
        openai_tool("call_4", "finish", {"reason": "verified"}),
    ]
    result = run(openai_at(server.url), tmp_path)
    assert result.verified and result.stop.kind == "finished" and result.turns == 4
    assert result.usage.total == 4 * 150 and result.tool_errors == 1
    assert result.cost_usd == pytest.approx((480 * 0.4 + 120 * 1.6) / 1e6)

    first, _, third = (r.body for r in server.requests[:3])
    assert all(r.path == "/v1/chat/completions" for r in server.requests)
    assert server.requests[0].headers["authorization"] == "Bearer sk-oai-test"
    assert first["model"] == "gpt-4.1-mini"
    assert first["messages"][0]["role"] == "system" and first["messages"][1]["role"] == "user"
    tools = first["tools"]
    assert [t["type"] for t in tools] == ["function"] * 3
    check_submit_schema(tools[0]["function"]["parameters"])
    # the Report of call_1, then the JSON error for call_2 (its raw arguments sent back verbatim)
    roles = [m["role"] for m in third["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    report, bad_call, error = third["messages"][3], third["messages"][4], third["messages"][5]
    assert report["tool_call_id"] == "call_1" and "FAILED at semantics" in report["content"]
    assert bad_call["tool_calls"][0]["function"]["arguments"] == "{this is not json"
    assert error["tool_call_id"] == "call_2" and "not valid JSON" in error["content"]


def first_user_text(body: dict[str, Any]) -> str:
    """The text of a request's first user message (the task), in either wire format."""
    message = next(m for m in body["messages"] if m["role"] == "user")
    content = message["content"]
    return content if isinstance(content, str) else "".join(b.get("text", "") for b in content)


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_model_gets_what_the_planner_could_not_lower(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    """A block the built-in planner cannot lower whole still runs with an LLM provider, and its
    task lists every op the planner left and the partial Program of the rest."""
    provider, tool, _ = VENDORS[vendor]
    server.replies = [tool("t1", "finish", {"reason": "seen"})]
    result = synthesize(
        MIXED, tmp_path, provider=provider(server.url), sandbox=FAST, retry=QUICK_RETRY
    )
    assert result.stop.kind == "finished" and len(server.requests) == 1
    task = first_user_text(server.requests[0].body)
    assert "def mixed(x, w, w2, g):" in task
    assert "## What the built-in planner could not lower" in task
    assert "- graph[1] test_mystery(out='m'): no lowering rule — no rule for op" in task
    assert "- graph[2] linear(out='z'): not judged — it reads 'm', which graph[1]" in task
    assert "- graph[3] rmsnorm(out='n'): no lowering rule — its output 'n' feeds" in task
    partial = task.split("```json\n")[-1].split("```")[0]  # the last JSON block of the task
    expected = lower_partial(MIXED).partial
    assert expected is not None and Program.parse(partial) == expected.program


@pytest.mark.parametrize("vendor", VENDORS)
def test_rate_limit_is_retried_with_backoff(server: FakeLLM, tmp_path: Path, vendor: str) -> None:
    provider, tool, _ = VENDORS[vendor]
    limited = Reply(429, {"error": {"type": "rate_limit_error", "message": "slow down"}})
    limited.headers["retry-after"] = "0"
    server.replies = [limited, tool("t1", "finish", {"reason": "ok"})]
    result = run(provider(server.url), tmp_path)
    assert result.stop.kind == "finished" and result.retries == 1 and len(server.requests) == 2


@pytest.mark.parametrize("vendor", VENDORS)
def test_server_errors_give_up_with_a_clear_message(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    provider, _, _ = VENDORS[vendor]
    server.replies = [Reply(500, {"error": {"message": "boom"}}) for _ in range(5)]
    result = run(provider(server.url), tmp_path)
    assert result.stop.kind == "provider_error" and result.stop.exit_code == 1
    assert "HTTP 500" in result.stop.message and "boom" in result.stop.message
    assert "gave up after 3 attempts" in result.stop.message and len(server.requests) == 3


@pytest.mark.parametrize("vendor", VENDORS)
def test_an_unreachable_server_is_a_clear_error(tmp_path: Path, vendor: str) -> None:
    provider, _, _ = VENDORS[vendor]
    url = f"http://127.0.0.1:{closed_port()}"
    result = run(provider(url), tmp_path)
    assert result.stop.kind == "provider_error" and "cannot reach" in result.stop.message
    assert "127.0.0.1" in result.stop.message and "--base-url" in result.stop.message


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"foo": 1}, "malformed"),
        ("<html>", "not JSON"),
        ("[" * 200_000 + "]" * 200_000, "the body's JSON is nested too deeply to read"),
        (
            '{"a": ' + "9" * 5000 + "}",
            "the body's JSON cannot be read (Exceeds the limit (4300 digits) for integer string "
            "conversion: value has 5000 digits)",
        ),
    ],
    ids=["fields", "html", "deep", "long-number"],
)
def test_a_malformed_response_is_a_clear_error(
    server: FakeLLM, tmp_path: Path, vendor: str, body: Any, fragment: str
) -> None:
    provider, _, _ = VENDORS[vendor]
    server.replies = [Reply(200, body)]
    result = run(provider(server.url), tmp_path)
    assert result.stop.kind == "provider_error" and fragment in result.stop.message
    assert len(server.requests) == 1  # not retried


@pytest.mark.parametrize(
    "vendor,key_var", [("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY")]
)
def test_a_rejected_key_is_a_configuration_error(
    server: FakeLLM, tmp_path: Path, vendor: str, key_var: str
) -> None:
    provider, _, _ = VENDORS[vendor]
    server.replies = [Reply(401, {"error": {"message": "invalid x-api-key"}})]
    result = run(provider(server.url), tmp_path)
    assert result.stop.exit_code == 2 and "HTTP 401" in result.stop.message
    assert f"check {key_var}" in result.stop.message and len(server.requests) == 1


def test_a_missing_key_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ProviderError, match="ANTHROPIC_API_KEY is not set") as err:
        AnthropicProvider()
    assert err.value.exit_code == 2
    with pytest.raises(ProviderError, match="OPENAI_API_KEY is not set") as err:
        OpenAIProvider()
    assert err.value.exit_code == 2
    # an OpenAI-compatible server at --base-url may need no key
    assert OpenAIProvider("llama", base_url="http://127.0.0.1:1/v1").model == "llama"


@pytest.mark.parametrize(
    "url,problem",
    [
        ("http://[::1", "it cannot be parsed (Invalid IPv6 URL)"),
        ("notaurl", "its scheme is missing, not http or https"),
        ("ftp://127.0.0.1/v1", "its scheme is ftp, not http or https"),
        ("http://", "it names no host"),
        ("http://127.0.0.1:99999", "it cannot be parsed (Port out of range"),
    ],
)
def test_a_base_url_that_is_not_an_http_url_is_a_configuration_error(
    url: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    for name in ("anthropic", "openai"):
        with pytest.raises(ProviderError, match="is not a usable URL") as err:
            make_provider(name, BLOCK, base_url=url)
        assert err.value.exit_code == 2 and problem in err.value.message
        assert err.value.message.startswith(f"--base-url {url!r} is not a usable URL")
    with pytest.raises(ProviderError, match="is not a usable URL") as err:
        AnthropicProvider(base_url=url)
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    with pytest.raises(ProviderError, match=f"OPENAI_BASE_URL {re.escape(repr(url))}") as err:
        OpenAIProvider()
    assert err.value.exit_code == 2


def test_a_text_block_whose_text_is_null_is_recorded_as_empty(
    server: FakeLLM, tmp_path: Path
) -> None:
    server.replies = [
        anthropic_message(
            {"type": "text", "text": None},
            {"type": "tool_use", "id": "t1", "name": "finish", "input": {"reason": "ok"}},
        )
    ]
    result = run(anthropic_at(server.url), tmp_path)
    assert result.stop.kind == "finished"
    assert transcript_messages(tmp_path)[1]["parts"][0] == {"kind": "text", "text": ""}


def test_refusals_end_the_run(server: FakeLLM, tmp_path: Path) -> None:
    server.replies = [
        anthropic_message(
            stop="refusal",
            stop_details={"type": "refusal", "category": None, "explanation": "Declined."},
        )
    ]
    result = run(anthropic_at(server.url), tmp_path / "a")
    assert result.stop.kind == "refused" and "Declined." in result.stop.message

    server.replies = [openai_completion(refusal="I can't help with that.", finish="stop")]
    result = run(openai_at(server.url), tmp_path / "b")
    assert result.stop.kind == "refused" and "I can't help with that." in result.stop.message


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_server_that_never_answers_is_cut_off_at_the_runs_timeout(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    provider, _, _ = VENDORS[vendor]
    server.replies = [STALL] * 4  # the provider's own request timeout is 600 s
    start = time.monotonic()
    result = run(provider(server.url), tmp_path, Budgets(timeout_s=3))
    assert time.monotonic() - start < 6
    assert result.stop.kind == "timeout" and result.turns == 0, result.stop
    assert result.stop.message.startswith(
        "ran out of wall-clock time (--timeout 3 s) waiting for the provider: the request was "
        "cut off when it ran out"
    )
    assert len(server.requests) == 1  # no retry past the deadline


def dripping(reply: Reply, drip_s: float = 0.05) -> Reply:
    """``reply`` sent one byte every ``drip_s`` seconds (a few hundred bytes: 15 s or more)."""
    reply.drip_s = drip_s
    return reply


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_reply_that_trickles_in_is_cut_off_at_the_runs_timeout(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    provider, tool, _ = VENDORS[vendor]
    server.replies = [dripping(tool("t1", "finish", {"reason": "ok"})) for _ in range(2)]
    start = time.monotonic()
    result = run(provider(server.url), tmp_path, Budgets(timeout_s=2))
    assert time.monotonic() - start < 6  # each byte came well within httpx's read timeout
    assert result.stop.kind == "timeout" and result.turns == 0, result.stop
    assert result.stop.message.startswith(
        "ran out of wall-clock time (--timeout 2 s) waiting for the provider: the request was "
        "cut off when it ran out"
    )
    assert "sent no whole reply in 2.0 s" in result.stop.message and len(server.requests) == 1


@pytest.mark.parametrize("vendor", VENDORS)
def test_without_a_run_timeout_a_request_is_cut_off_at_the_providers_own_cap(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    make = AnthropicProvider if vendor == "anthropic" else OpenAIProvider
    url = server.url if vendor == "anthropic" else f"{server.url}/v1"
    provider = make(None, base_url=url, api_key="sk-test", request_timeout_s=1.0)
    _, tool, _ = VENDORS[vendor]
    server.replies = [dripping(tool("t1", "finish", {"reason": "ok"})) for _ in range(2)]
    start = time.monotonic()
    result = synthesize(
        BLOCK,
        tmp_path,
        provider=provider,
        sandbox=FAST,
        retry=RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.01),
    )
    assert time.monotonic() - start < 8
    assert result.stop.kind == "provider_error" and result.turns == 0, result.stop
    assert "sent no whole reply in 1.0 s, the longest one request may take" in result.stop.message
    assert "gave up after 2 attempts" in result.stop.message and len(server.requests) == 2


BAD_USAGE = [
    ((-999_999, 30), "input_tokens", "prompt_tokens", "-999999"),
    ((120, 2.5), "output_tokens", "completion_tokens", "2.5"),
    ((MAX_TOKEN_COUNT + 1, 30), "input_tokens", "prompt_tokens", str(MAX_TOKEN_COUNT + 1)),
    ((10**400, 30), "input_tokens", "prompt_tokens", "100000000000… (401 digits)"),
]


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("usage,anthropic_field,openai_field,shown", BAD_USAGE)
def test_impossible_token_counts_stop_the_run_uncounted(
    server: FakeLLM,
    tmp_path: Path,
    vendor: str,
    usage: tuple,
    anthropic_field: str,
    openai_field: str,
    shown: str,
) -> None:
    provider, tool, _ = VENDORS[vendor]
    bad = (
        anthropic_message(usage=usage)
        if vendor == "anthropic"
        else openai_completion(content="hi", finish="stop", usage=usage)
    )
    server.replies = [tool("t1", "describe_primitive", {"name": "swiglu"}), bad]
    result = run(provider(server.url), tmp_path, Budgets(max_tokens=10_000, max_cost=1.0))
    assert result.stop.kind == "provider_error" and result.stop.exit_code == 1
    field = anthropic_field if vendor == "anthropic" else openai_field
    assert f"`usage.{field}` is {shown}, not a token count" in result.stop.message
    assert result.turns == 1 and result.usage.total == 150  # only the good turn is counted
    assert result.cost_usd is not None and result.cost_usd > 0


def transcript_messages(tmp_path: Path) -> list[dict[str, Any]]:
    (run_dir,) = tmp_path.iterdir()
    lines = (run_dir / "transcript.jsonl").read_text().splitlines()
    assert sum(map(len, lines)) < 2 * MAX_PART_CHARS + 200_000  # not the 10 MB
    return [r["message"] for r in map(json.loads, lines) if r["event"] == "message"]


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_10_mb_tool_call_is_cut_in_the_transcript_and_answered_with_an_error(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    provider, tool, _ = VENDORS[vendor]
    huge = {"program": {"block": "llama_mlp", "steps": ["x" * 10_000_000]}}
    server.replies = [tool("t1", "submit_program", huge), tool("t2", "finish", {"reason": "ok"})]
    result = run(provider(server.url), tmp_path)
    assert result.stop.kind == "finished" and result.candidates == [] and result.tool_errors == 1
    recorded = transcript_messages(tmp_path)[1]["parts"][-1]["arguments"]
    sent = len(json.dumps(huge))  # both adapters keep the arguments as this JSON text
    assert recorded.startswith('{"program": {"block": "llama_mlp", "steps": ["xxx')
    assert recorded.endswith(
        f"[… {sent - MAX_PART_CHARS} characters cut: a reply part is kept up to "
        f"{MAX_PART_CHARS} characters]"
    )
    second = json.dumps(server.requests[1].body)
    assert len(second) < 2 * MAX_PART_CHARS + 100_000  # the history sent back is cut too
    assert f"its arguments were {sent} characters, over the {MAX_PART_CHARS}-character" in second


def test_a_10_mb_text_is_cut_in_the_transcript_and_the_model_is_told(
    server: FakeLLM, tmp_path: Path
) -> None:
    text = "blah " * 2_000_000
    server.replies = [
        anthropic_message({"type": "text", "text": text}, stop="end_turn"),
        anthropic_tool("t1", "finish", {"reason": "ok"}),
    ]
    result = run(anthropic_at(server.url), tmp_path)
    assert result.stop.kind == "finished" and result.tool_errors == 1
    messages = transcript_messages(tmp_path)
    kept = messages[1]["parts"][0]["text"]
    assert kept.startswith("blah blah") and f"[… {len(text) - MAX_PART_CHARS} characters" in kept
    (note,) = messages[2]["parts"]
    assert note["content"].startswith(
        f"Your reply's text was {len(text)} characters, over the {MAX_PART_CHARS}-character limit"
    )
    assert "Reply with a tool call" in note["content"]


def test_anthropic_cache_reads_and_writes_are_priced_at_the_cache_rates(
    server: FakeLLM, tmp_path: Path
) -> None:
    reply = anthropic_tool("t1", "finish", {"reason": "ok"})
    reply.body["usage"].update(cache_creation_input_tokens=2_000, cache_read_input_tokens=10_000)
    server.replies = [reply]
    result = run(anthropic_at(server.url), tmp_path)  # claude-haiku-4-5: $1 in, $5 out
    usage = result.usage
    assert (usage.input_tokens, usage.cache_write_tokens, usage.cache_read_tokens) == (
        12_120,
        2_000,
        10_000,
    )
    # 120 uncached at $1, 2,000 written at $1.25, 10,000 read at $0.10, 30 out at $5 per Mtok
    assert result.cost_usd == pytest.approx(0.00377)
    (run_dir,) = tmp_path.iterdir()
    summary = (run_dir / "summary.md").read_text()
    assert "12,150 (12,120 in: 10,000 read from the prompt cache, 2,000 written to it; 30 out)" in (
        summary
    )
    end = json.loads((run_dir / "transcript.jsonl").read_text().splitlines()[-1])
    assert (end["cache_write_tokens"], end["cache_read_tokens"]) == (2_000, 10_000)
    assert RunState.from_transcript(read_transcript(run_dir / "transcript.jsonl")).usage == usage
    # a transcript written before the cache counts were recorded still reads
    old = tmp_path / "old.jsonl"
    text = (run_dir / "transcript.jsonl").read_text()
    for field in ("cache_write_tokens", "cache_read_tokens"):
        text = re.sub(f', "{field}": [0-9]+', "", text)
    old.write_text(text)
    assert "cache_" not in text
    state = RunState.from_transcript(read_transcript(old))
    assert state.usage.input_tokens == 12_120 and state.usage.cache_read_tokens == 0


def test_openai_cached_tokens_are_priced_at_the_cached_input_rate(
    server: FakeLLM, tmp_path: Path
) -> None:
    reply = openai_tool("c1", "finish", {"reason": "ok"})
    reply.body["usage"].update(prompt_tokens=10_000, prompt_tokens_details={"cached_tokens": 8_000})
    server.replies = [reply]
    result = run(openai_at(server.url), tmp_path)  # gpt-4.1-mini: $0.40 in, $0.10 cached, $1.60 out
    assert (result.usage.input_tokens, result.usage.cache_read_tokens) == (10_000, 8_000)
    assert result.cost_usd == pytest.approx((2_000 * 0.4 + 8_000 * 0.1 + 30 * 1.6) / 1e6)


@pytest.mark.parametrize("vendor", VENDORS)
def test_cached_counts_that_cannot_be_are_a_provider_error(
    server: FakeLLM, tmp_path: Path, vendor: str
) -> None:
    provider, tool, _ = VENDORS[vendor]
    reply = tool("t1", "finish", {"reason": "ok"})
    if vendor == "anthropic":
        reply.body["usage"]["cache_read_input_tokens"] = -5
        shown = "`usage.cache_read_input_tokens` is -5, not a token count"
    else:
        reply.body["usage"]["prompt_tokens_details"] = {"cached_tokens": 121}
        shown = "counts 121 cached tokens, more than the 120 `usage.prompt_tokens`"
    server.replies = [reply]
    result = run(provider(server.url), tmp_path)
    assert result.stop.kind == "provider_error" and shown in result.stop.message
    assert result.turns == 0 and result.usage.total == 0


def test_usage_keeps_the_cached_tokens_within_the_input() -> None:
    with pytest.raises(ValidationError, match=r"\(6\) exceed input_tokens \(5\)"):
        Usage(input_tokens=5, cache_read_tokens=6)
    with pytest.raises(ValidationError, match="cache_write_tokens"):
        Usage(input_tokens=5, cache_write_tokens=-1)
    total = Usage(input_tokens=10, cache_read_tokens=4) + Usage(
        input_tokens=3, cache_write_tokens=3
    )
    assert total == Usage(input_tokens=13, cache_write_tokens=3, cache_read_tokens=4)
    assert total.uncached_input_tokens == 6


def test_openai_requests_share_a_byte_identical_prefix(server: FakeLLM, tmp_path: Path) -> None:
    """OpenAI caches the prefix a request shares with earlier ones: each turn's request must
    start with the previous request's bytes (tools, system prompt, conversation so far)."""
    server.replies = [
        openai_tool("call_1", "submit_program", {"program": broken_program()}),
        openai_tool("call_2", "describe_primitive", {"name": "swiglu"}),
        openai_tool("call_3", "finish", {"reason": "done"}),
    ]
    provider = OpenAIProvider(
        "gpt-4.1-mini", base_url=f"{server.url}/v1", api_key="sk-oai-test", cache_key=True
    )
    run(provider, tmp_path)
    bodies = [r.body for r in server.requests]
    assert len(bodies) == 3
    for before, after in zip(bodies, bodies[1:], strict=False):
        assert json.dumps(after["tools"]) == json.dumps(before["tools"])
        sent = len(before["messages"])
        assert len(after["messages"]) > sent
        assert json.dumps(after["messages"][:sent]) == json.dumps(before["messages"])
        assert after["prompt_cache_key"] == before["prompt_cache_key"]
    assert bodies[0]["prompt_cache_key"].startswith("coda-")
    # another OpenAI-compatible server is not sent a field it may not know
    server.replies = [openai_tool("c1", "finish", {"reason": "ok"})]
    run(openai_at(server.url), tmp_path / "plain")
    assert "prompt_cache_key" not in server.requests[-1].body


def test_a_10_turn_anthropic_run_bills_at_most_a_quarter_of_its_input_with_caching(
    server: FakeLLM, tmp_path: Path
) -> None:
    """Against a server that models Anthropic's prompt cache (``PromptCache``), a 10-turn run
    bills at most 25% of the input-token equivalent of the same requests without caching (writes
    ×1.25, reads ×0.1, uncached ×1, against every input token ×1)."""
    server.cache = PromptCache(min_tokens=4096)  # claude-haiku-4-5's minimum cacheable prefix
    names = ["swiglu", "rstd", "scale_rows", "store", "add_tile", "interleave_rows"]
    server.replies = [
        anthropic_tool("t1", "submit_program", {"program": broken_program()}),
        *(anthropic_tool(f"d{i}", "describe_primitive", {"name": n}) for i, n in enumerate(names)),
        anthropic_tool("t2", "submit_program", {"program": broken_program()}),
        anthropic_tool("t3", "submit_program", {"program": good_program()}),
        anthropic_tool("t4", "finish", {"reason": "verified"}),
    ]
    result = run(anthropic_at(server.url), tmp_path)
    assert result.stop.kind == "finished" and result.turns == 10 and result.verified
    usage = result.usage
    uncached = usage.input_tokens
    billed = (
        usage.uncached_input_tokens
        + 1.25 * usage.cache_write_tokens
        + 0.1 * usage.cache_read_tokens
    )
    assert usage.cache_read_tokens > 0 and usage.cache_write_tokens > 0
    assert billed <= 0.25 * uncached, (billed / uncached, usage)
    # and the dollar cost is that billed-equivalent at claude-haiku-4-5's $1 / Mtok input
    assert result.cost_usd == pytest.approx((billed * 1.0 + usage.output_tokens * 5.0) / 1e6)


def test_anthropic_parallel_tool_calls_get_their_results_in_one_user_message(
    server: FakeLLM, tmp_path: Path
) -> None:
    server.replies = [
        anthropic_message(
            {"type": "text", "text": "two variants at once"},
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "submit_program",
                "input": {"program": broken_program()},
            },
            {
                "type": "tool_use",
                "id": "toolu_b",
                "name": "submit_program",
                "input": {"program": good_program()},
            },
        ),
        anthropic_tool("toolu_c", "finish", {"reason": "verified"}),
    ]
    result = run(anthropic_at(server.url), tmp_path)
    assert result.verified and result.stop.kind == "finished" and result.turns == 2
    assert [c.tool_call_id for c in result.candidates] == ["toolu_a", "toolu_b"]
    _, assistant, results = server.requests[1].body["messages"]
    assert [b["id"] for b in assistant["content"] if b["type"] == "tool_use"] == [
        "toolu_a",
        "toolu_b",
    ]
    # one user message answers both calls, one tool_result block each, in call order
    assert results["role"] == "user"
    first, second = results["content"]
    assert (first["type"], first["tool_use_id"]) == ("tool_result", "toolu_a")
    assert (second["type"], second["tool_use_id"]) == ("tool_result", "toolu_b")
    assert first["content"].startswith("Candidate 1: FAILED at semantics")
    assert second["content"].startswith("Candidate 2: VERIFIED")


def test_openai_parallel_tool_calls_get_one_tool_message_per_call_id(
    server: FakeLLM, tmp_path: Path
) -> None:
    server.replies = [
        openai_completion(
            calls=[
                ("call_a", "submit_program", {"program": broken_program()}),
                ("call_b", "submit_program", {"program": good_program()}),
            ]
        ),
        openai_tool("call_c", "finish", {"reason": "verified"}),
    ]
    result = run(openai_at(server.url), tmp_path)
    assert result.verified and result.stop.kind == "finished" and result.turns == 2
    assert [c.tool_call_id for c in result.candidates] == ["call_a", "call_b"]
    messages = server.requests[1].body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_a", "call_b"]
    first, second = messages[3:]
    assert first["tool_call_id"] == "call_a" and second["tool_call_id"] == "call_b"
    assert first["content"].startswith("Candidate 1: FAILED at semantics")
    assert second["content"].startswith("Candidate 2: VERIFIED")
