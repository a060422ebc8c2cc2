"""DeepSeek-V4.1's conversation encoding: a list of chat messages -> the prompt text.

The format, as DeepSeek's own encoder produces it:

    <｜begin▁of▁sentence｜>[<｜System｜>[Reasoning Effort: N (...)\\n\\n]system text]
    <｜User｜>user text<｜Assistant｜></think>reply<｜end▁of▁sentence｜>
    <｜User｜>next question<｜Assistant｜></think>            <- generation starts here

* Chat mode closes the thinking block at once (`</think>`); thinking mode
  opens it (`<think>`) after the last user turn, and only then: earlier
  assistant turns lose their reasoning and keep `</think>` before the reply.
* Thinking mode starts the conversation with a numeric reasoning effort,
  1..100 ("low" = 50, "high" = 75, the default, "max" = 100), inside the
  leading `<｜System｜>` block.
* A system message after the first one is a mid-conversation instruction:
  `<｜System｜>` + text, and like a user turn it hands over to the assistant.
* An assistant turn in thinking mode after the last user turn carries its
  `reasoning_content` before `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

EFFORT_NAMES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
ROLES = ("system", "user", "assistant")
# the error for a prompt with nothing in it: the server's 400 and the CLI's `--prompt ""` say the same
EMPTY_PROMPT = "the prompt is empty"


class ChatFormatError(ValueError):
    """A message list this encoder cannot render; the message says which message and why."""


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    reasoning: str = ""


def _turns(messages) -> list[Turn]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatFormatError(f"messages[{i}].content[{j}]: only text parts are supported")
                texts.append(part["text"])
            content = "\n\n".join(texts)
        if not isinstance(content, str):
            raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ChatFormatError(f"messages[{i}].reasoning_content must be a string")
        for field in ("tool_calls", "tools"):
            if m.get(field):
                raise ChatFormatError(f"messages[{i}].{field}: tool calling is not supported by this server")
        if role == "user" and turns and turns[-1].role == "user":  # consecutive user messages form one turn
            turns[-1] = Turn("user", turns[-1].content + "\n\n" + content)
            continue
        turns.append(Turn(role, content, reasoning))
    return turns


def reasoning_budget(effort: str | int | None) -> int:
    """The numeric reasoning effort (1..100) for a name, a number, or None (the default)."""
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, str) and effort in EFFORT_NAMES:
        return EFFORT_NAMES[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ChatFormatError(f"reasoning_effort must be an integer 1..100 or one of {', '.join(EFFORT_NAMES)}; "
                          f"got {effort!r}")


def encode_chat(messages, thinking: bool = False, reasoning_effort: str | int | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text for a conversation (list of {"role", "content"[, "reasoning_content"]})."""
    turns = _turns(messages)
    last_user = max((i for i, t in enumerate(turns) if t.role == "user" or (t.role == "system" and i > 0)),
                    default=-1)
    out = [BOS]
    if thinking:
        out.append(SYSTEM + f"Reasoning Effort: {reasoning_budget(reasoning_effort)} (range 1-100, the higher "
                            "the value, the more thorough the reasoning)\n\n")
    elif reasoning_effort is not None:
        raise ChatFormatError("reasoning_effort applies to thinking mode only")
    for i, t in enumerate(turns):
        if t.role == "system":
            out.append(t.content if i == 0 and thinking else SYSTEM + t.content)
        elif t.role == "user":
            out.append(USER + t.content)
        else:
            keeps_reasoning = thinking and i > last_user
            out.append((t.reasoning + THINK_CLOSE if keeps_reasoning else "") + t.content + EOS)
        hands_over = t.role == "user" or (t.role == "system" and i > 0)
        next_role = turns[i + 1].role if i + 1 < len(turns) else None
        if hands_over and (next_role == "assistant" or (next_role is None and add_generation_prompt)):
            out.append(ASSISTANT + (THINK_OPEN if thinking and i >= last_user else THINK_CLOSE))
    return "".join(out)
