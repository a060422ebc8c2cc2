"""Serving agents: tool calls, streamed usage and Anthropic's Messages API, through the
official `openai` and `anthropic` clients on a loopback server.

The tiny model writes random tokens, so the replies that must hold tool calls are scripted:
`script` makes the engine's generation yield chosen text (and records the prompts it got).
A few requests run the real model to show the wiring end to end."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

import dsv41_mlx
import dsv41_mlx.server as server
from dsv41_mlx.chat import encode_chat
from dsv41_mlx.generate import GenerationResponse, stream_generate
from dsv41_mlx.server import Engine, create_app

from .test_server import serving

MODEL = "dsv41-tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = ('\n\n<｜DSML｜ calls>\n'
         '<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
         '</｜DSML｜ invoke>\n'
         '<｜DSML｜ invoke name="get_time">\n\n</｜DSML｜ invoke>\n'
         '</｜DSML｜ calls>')
BROKEN = CALLS.replace('string="false">2', 'string="false">two')


def pieces(text: str, size: int = 5) -> list[str]:
    return [text[i: i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = dsv41_mlx.load()
    return Engine(model, tokenizer, MODEL)


@pytest.fixture(scope="module")
def live(engine):
    with serving(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live, api_key="unused", max_retries=0)


@pytest.fixture
def script(monkeypatch, engine):
    """script(texts, finish) makes the model write `texts` one piece per token, then stop at
    EOS ("stop") or run out of tokens ("length"); returns the list of prompts (as text) it got."""
    prompts = []

    def use(texts: list[str], finish: str = "stop"):
        def generate(model, tokenizer, ids, **options):
            prompts.append(engine.tokenizer.decode(ids))
            out = texts + [""] if finish == "stop" else texts  # EOS: one more token, no text
            for n, text in enumerate(out, 1):
                yield GenerationResponse(text, n, len(ids), 0.0, n, 0.0, 0.0, finish if n == len(out) else None)

        monkeypatch.setattr(server, "stream_generate", generate)
        return prompts

    return use


def solo(engine, text: str, max_tokens: int) -> str:
    ids = engine.tokenizer.encode(text)
    return "".join(r.text for r in stream_generate(engine.model, engine.tokenizer, ids, max_tokens=max_tokens))


# ------------------------------------------------------------ OpenAI: tools

def test_tools_reach_the_prompt_and_a_reply_without_calls_stays_text(oai, engine):
    """The real model: the prompt is the encoder's, with its tools section; the random reply is plain text."""
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4)
    prompt = encode_chat(ASK, tools=[WEATHER])
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert r.choices[0].message.content == solo(engine, prompt, 4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None


def test_a_dsml_reply_comes_back_as_tool_calls(oai, script):
    script(pieces("Let me check." + CALLS))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris", "days": 2}), ("function", "get_time", {})]
    assert all(c.id.startswith("call_") for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == 2


def test_streamed_tool_calls_arrive_as_tool_call_deltas(oai, script):
    script(pieces("Let me check." + CALLS, 3))
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["type"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("function", "get_weather", {"city": "Paris", "days": 2}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_block_is_returned_as_text_with_finish_stop(oai, script, stream):
    script(pieces("Let me check." + BROKEN))
    if stream:
        chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
    else:
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.tool_calls is None
    assert content == "Let me check." + BROKEN and finish == "stop"


def test_a_call_cut_off_by_max_tokens_is_text_with_finish_length(oai, script):
    script(pieces("Let me check." + CALLS)[:6], finish="length")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ("Let me check." + CALLS)[:30]


def test_a_named_tool_choice_lists_that_tool_alone_and_opens_its_call(oai, script):
    prompts = script(pieces('<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
                            '</｜DSML｜ invoke>\n</｜DSML｜ calls>'))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert prompts[-1].endswith('<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n')
    assert '"name": "get_weather"' in prompts[-1] and '"name": "get_time"' not in prompts[-1]
    call, = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_required_tool_choice_lets_the_model_name_the_tool(oai, script):
    prompts = script(pieces('get_time">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")
    assert prompts[-1].endswith('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="')
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]


def test_tool_choice_none_shows_no_tools_and_parses_no_calls(oai, script):
    prompts = script(pieces("Sure." + CALLS))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "## Tools" not in prompts[-1]
    assert r.choices[0].message.content == "Sure." + CALLS and r.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(oai, script):
    script(pieces(CALLS))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_a_tool_result_conversation_is_encoded_in_the_prompt(oai, script):
    prompts = script(["It is sunny."])
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert prompts[-1] == encode_chat(messages, tools=[WEATHER])
    assert "<tool_result>sunny, 21C</tool_result><｜Assistant｜></think>" in prompts[-1]
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_replies_carry_reasoning_content_apart_from_the_answer(oai, script, stream):
    script(["The user", " asks.</thi", "nk>Paris is", " mild."])
    request = {"model": MODEL, "messages": ASK, "extra_body": {"thinking": True}}
    if stream:
        deltas = [c.choices[0].delta for c in oai.chat.completions.create(stream=True, **request)]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = oai.chat.completions.create(**request).choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
    assert (reasoning, content) == ("The user asks.", "Paris is mild.")


@pytest.mark.parametrize("body, param, names", [
    ({"tools": {"type": "function"}}, "tools", "tools must be a non-empty list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0].type must be 'function'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "names 'get_time', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "thinking": True}, "tool_choice", "thinking mode"),
    ({"tool_choice": "required"}, "tool_choice", "defines no tools"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "'parallel_tool_calls' must be true or false"),
    ({"messages": ASK + [{"role": "tool", "content": "21C"}]}, "messages", "messages[1].tool_call_id is required"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{'city': 'Paris'}"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not valid JSON"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(live, body, param, names):
    r = httpx.post(live + "/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert names in error["message"] and error["param"] == param


# ------------------------------------------------------ OpenAI: streamed usage

def test_include_usage_sends_one_last_chunk_with_the_usage_and_no_choices(oai):
    request = {"model": MODEL, "messages": ASK, "max_tokens": 5}
    plain = oai.chat.completions.create(**request)
    *chunks, last = oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
    assert last.choices == [] and last.usage == plain.usage
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    without = list(oai.chat.completions.create(stream=True, **request))
    assert all(c.usage is None and c.choices for c in without) and len(without) == len(chunks)


def test_stream_options_without_stream_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, stream_options={"include_usage": True})
    assert "'stream_options' is only allowed when 'stream' is true" in e.value.message


# ------------------------------------------------------ Anthropic's Messages API

WEATHER_TOOL = {"name": "get_weather", "description": "Current weather",
                "input_schema": WEATHER["function"]["parameters"]}
CLOCK_TOOL = {"name": "get_time", "input_schema": CLOCK["function"]["parameters"]}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_message_is_the_same_generation_as_the_chat_endpoint(claude, engine):
    """The real model: same prompt encoding, same reply; max_tokens is the stop reason."""
    m = claude.messages.create(model=MODEL, max_tokens=4, system="Be brief.", messages=USER)
    prompt = encode_chat([{"role": "system", "content": "Be brief."}] + USER)
    assert m.usage.input_tokens == len(engine.tokenizer.encode(prompt)) and m.usage.output_tokens == 4
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == solo(engine, prompt, 4)
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.model == MODEL


def test_a_dsml_reply_comes_back_as_tool_use_blocks(claude, script):
    prompts = script(pieces("Let me check." + CALLS))
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=USER, tools=[WEATHER_TOOL, CLOCK_TOOL])
    assert prompts[-1] == encode_chat(USER, tools=[WEATHER, CLOCK])
    assert m.stop_reason == "tool_use" and m.content[0].text == "Let me check."
    assert [(b.type, b.name, b.input) for b in m.content[1:]] == [
        ("tool_use", "get_weather", {"city": "Paris", "days": 2}), ("tool_use", "get_time", {})]
    assert all(b.id.startswith("toolu_") for b in m.content[1:])


def test_a_streamed_message_sends_anthropics_events_and_adds_up_to_the_message(claude, script):
    script(pieces("Let me check." + CALLS, 4))
    request = {"model": MODEL, "max_tokens": 100, "messages": USER, "tools": [WEATHER_TOOL, CLOCK_TOOL]}
    events = list(claude.messages.create(stream=True, **request))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use", "tool_use"] and kinds.count("content_block_stop") == 3
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"text_delta", "input_json_delta"}
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens > 0
    with claude.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Let me check." and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content[1:]] == [("get_weather", {"city": "Paris", "days": 2}),
                                                              ("get_time", {})]


def test_tool_use_and_tool_result_blocks_are_encoded_like_the_openai_messages(claude, script):
    prompts = script(["Sunny", " in both."])
    history = USER + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "Rome: sun"}]},
            {"type": "tool_result", "tool_use_id": "t1", "content": "Paris: sun"},
            {"type": "text", "text": "Summarise."}]}]
    m = claude.messages.create(model=MODEL, max_tokens=50, system=[{"type": "text", "text": "Be brief."}],
                               messages=history, tools=[WEATHER_TOOL])
    same = [{"role": "system", "content": "Be brief."}] + ASK + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "t2", "content": "Rome: sun"},
        {"role": "tool", "tool_call_id": "t1", "content": "Paris: sun"},
        {"role": "user", "content": "Summarise."}]
    assert prompts[-1] == encode_chat(same, tools=[WEATHER])
    assert ("<tool_result>Paris: sun</tool_result>\n\n<tool_result>Rome: sun</tool_result>\n\nSummarise."
            in prompts[-1])
    assert m.content[0].text == "Sunny in both." and m.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_enabled_gives_a_thinking_block_then_the_answer(claude, script, stream):
    prompts = script(["The user", " asks.</thi", "nk>Paris is", " mild."])
    request = {"model": MODEL, "max_tokens": 2048, "messages": USER,
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with claude.messages.stream(**request) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**request)
    assert prompts[-1] == encode_chat(ASK, thinking=True)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "The user asks."), ("text", "Paris is mild.")]


def test_a_stop_sequence_ends_the_message_and_is_reported(claude, script):
    script(["Hello", " there STOP and", " more"])
    m = claude.messages.create(model=MODEL, max_tokens=20, messages=USER, stop_sequences=["STOP", "never"])
    assert m.content[0].text == "Hello there " and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")


def test_a_malformed_call_block_is_text_and_the_turn_ends(claude, script):
    script(pieces("Let me check." + BROKEN))
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=USER, tools=[WEATHER_TOOL, CLOCK_TOOL])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Let me check." + BROKEN
    assert m.stop_reason == "end_turn"


def test_tool_choice_tool_opens_the_named_call_and_none_hides_the_tools(claude, script):
    prompts = script(pieces('\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'))
    m = claude.messages.create(model=MODEL, max_tokens=50, messages=USER, tools=[WEATHER_TOOL, CLOCK_TOOL],
                               tool_choice={"type": "tool", "name": "get_time"})
    assert prompts[-1] == encode_chat(ASK, tools=[WEATHER, CLOCK],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_time", {})]
    claude.messages.create(model=MODEL, max_tokens=50, messages=USER, tools=[WEATHER_TOOL],
                           tool_choice={"type": "none"})
    assert prompts[-1] == encode_chat(ASK)


@pytest.mark.parametrize("body, status, kind, names", [
    ({"messages": USER}, 400, "invalid_request_error", "'max_tokens' is required"),
    ({"max_tokens": 5, "messages": USER, "model": None}, 400, "invalid_request_error", "'model' is required"),
    ({"max_tokens": 5, "messages": USER, "model": "claude-sonnet"}, 404, "not_found_error", "'claude-sonnet'"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     "messages[0] must be an object with role 'user' or 'assistant'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type must be one of text, tool_result"),
    ({"max_tokens": 5, "messages": USER + [{"role": "assistant", "content": "Paris is"}]}, 400,
     "invalid_request_error", "the last message must be a user message"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "only custom tools"),
    ({"max_tokens": 5, "messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "x"}},
     400, "invalid_request_error", "names 'x', which is not among the tools"),
    ({"max_tokens": 2048, "messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "any"},
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking mode"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "'thinking' must be"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, 400, "invalid_request_error", "'temperature'"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": "STOP"}, 400, "invalid_request_error",
     "'stop_sequences' must be a list"),
    ({"max_tokens": 5, "messages": USER, "top_logprobs": 2}, 400, "invalid_request_error",
     "unknown field 'top_logprobs'"),
    ({"max_tokens": 10**6, "messages": USER}, 400, "invalid_request_error", "'max_tokens' must be an integer from 1"),
])
def test_bad_messages_requests_get_anthropic_shaped_errors(live, body, status, kind, names):
    r = httpx.post(live + "/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and names in error["error"]["message"]


def test_the_anthropic_client_raises_its_own_error_types(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": 7}])
    assert "messages[0].content must be a string or a list of content blocks" in e.value.message


# ------------------------------------------- two turns: a tool call, its result, the cache

@pytest.fixture(scope="module")
def cached_live(engine):
    """A second server on the same model and runner, with a prompt cache."""
    from dsv41_mlx.runtime.prefix_cache import PrefixCache

    cached = Engine(engine.model, engine.tokenizer, MODEL, engine.runner, PrefixCache.for_chat(1 << 30, engine.tokenizer))
    with serving(create_app(cached)) as url:
        yield url, cached


@pytest.fixture
def recorded(monkeypatch, engine):
    """recorded(prompt, text): the real forwards run, but the tokens drawn are text's then EOS (a
    test double of the sampler: the model's own text is noise); plain decoding only."""
    import importlib

    import mlx.core as mx

    generate = importlib.import_module("dsv41_mlx.generate")  # (the package exports a function so named)

    def use(prompt: str, text: str):
        before = engine.tokenizer.encode(prompt)
        after = engine.tokenizer.encode(prompt + text + "<｜end▁of▁sentence｜>")
        assert after[: len(before)] == before
        tokens = iter(after[len(before):])  # the reply's tokens as they follow the prompt
        monkeypatch.setattr(generate, "draw_token", lambda runner, logits, position, params:
                            mx.array([next(tokens)], dtype=mx.int32))

    return use


def _reply_text(first: list[dict], assistant: dict, tools: list[dict]) -> str:
    """What the encoder renders for the assistant's turn after `first`: what the model wrote."""
    before, after = encode_chat(first, tools=tools), encode_chat(first + [assistant], tools=tools)
    assert after.startswith(before)
    return after[len(before):].removesuffix("<｜end▁of▁sentence｜>")


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_openai_two_turns_with_a_tool_call_and_its_result_resume_from_the_cache(cached_live, engine, recorded,
                                                                                  monkeypatch):
    """Turn 1: the model (its tokens recorded, its forwards real) calls get_weather; turn 2 sends
    the call and its result back: its prompt begins with turn 1's prompt and reply, so it
    resumes from the cached state (usage says how many tokens), and its reply is the one a cold
    prefill of the same prompt gives."""
    url, _ = cached_live
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    recorded(encode_chat(ASK, tools=[WEATHER]), _reply_text(ASK, ASSISTANT_CALL, [WEATHER]))
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60,
                                           extra_body={"draft": False})
    monkeypatch.undo()  # turn 2 samples for real
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], max_tokens=4,
                                            extra_body={"draft": False})
    prompt = encode_chat(turn2, tools=[WEATHER])
    assert second.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    # turn 1's prompt and its reply but the end-of-sentence token (no forward fed it)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.choices[0].message.content == solo(engine, prompt, 4)


def test_anthropic_two_turns_with_a_tool_use_and_its_result_resume_from_the_cache(cached_live, engine, recorded,
                                                                                   monkeypatch):
    """The same conversation through Anthropic's client: tool_use, then a tool_result block; the
    second message reports the cached tokens as cache_read_input_tokens."""
    url, _ = cached_live
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Lyon?"}]
    call = {**ASSISTANT_CALL, "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": '{"city": "Lyon"}'}}]}
    recorded(encode_chat(ask, tools=[WEATHER]), _reply_text(ask, call, [WEATHER]))
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER_TOOL],
                                   extra_body={"draft": False})
    monkeypatch.undo()
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and (use.name, use.input) == ("get_weather", {"city": "Lyon"})
    turn2 = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=turn2, tools=[WEATHER_TOOL],
                                    extra_body={"draft": False})
    assert second.usage.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens > second.usage.cache_read_input_tokens
