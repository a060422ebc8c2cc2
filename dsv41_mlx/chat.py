"""DeepSeek-V4.1's conversation encoding: a list of chat messages -> the prompt text, and the
model's reply -> reasoning, text and tool calls.

The format, as DeepSeek's own encoder produces it:

    <｜begin▁of▁sentence｜>[<｜System｜>[Reasoning Effort: N (...)\\n\\n]system text[\\n\\n## Tools ...]]
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

Tools (OpenAI function definitions) follow the leading system text as a "## Tools" section
that lists each definition as JSON; without a system message an empty one carries them.
With tools defined, thinking mode keeps every turn's reasoning and opens `<think>` after
every user turn. An assistant's tool calls follow its text as one DSML block:

    \\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls><｜end▁of▁sentence｜>

(`string="true"`: the value as is; `"false"`: the value in JSON). Tool results have no role
of their own: each is `<tool_result>...</tool_result>` in a user turn (a run of tool and
user messages is one turn, its parts joined by a blank line), in the order of the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML} invoke", f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML} parameter", f"</{DSML} parameter>"

EFFORT_NAMES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
# the error for a prompt with nothing in it: the server's 400 and the CLI's `--prompt ""` say the same
EMPTY_PROMPT = "the prompt is empty"

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatFormatError(ValueError):
    """A request this encoder cannot render; the message says which field and why, `param` names it."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def arguments_json(self) -> str:
        return _json(self.arguments)


@dataclass
class Turn:
    role: str  # system, user (tool results included) or assistant
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    parts: list[tuple[str | None, str]] = field(default_factory=list)  # a user turn's (call id or None, text)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content, where: str) -> str:
    """A message's content: a string, None, or a list of OpenAI text parts (joined by a blank line)."""
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}[{j}]: only text parts are supported")
            texts.append(part["text"])
        return "\n\n".join(texts)
    if not isinstance(content, str):
        raise ChatFormatError(f"{where} must be a string or a list of text parts")
    return content


def _tool_calls(calls, where: str) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ChatFormatError(f"{at} must be an object with a 'function'")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"{at}.type must be 'function'")
        name, arguments = call["function"].get("name"), call["function"].get("arguments")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{at}.function.name must be a non-empty string")
        if not isinstance(arguments, str):
            raise ChatFormatError(f"{at}.function.arguments must be a string of JSON")
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{at}.function.arguments is not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise ChatFormatError(f"{at}.function.arguments must be a JSON object")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{at}.id must be a string")
        out.append(ToolCall(name, arguments, call_id))
    return out


def _turns(messages) -> list[Turn]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = _text(m.get("content"), f"messages[{i}].content")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ChatFormatError(f"messages[{i}].reasoning_content must be a string")
        if m.get("tools"):
            raise ChatFormatError(f"messages[{i}].tools: tools belong in the request's 'tools' field")
        calls = []
        if m.get("tool_calls"):
            if role != "assistant":
                raise ChatFormatError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
            calls = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        if role in ("user", "tool"):
            call_id = None
            if role == "tool":
                call_id = m.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise ChatFormatError(f"messages[{i}].tool_call_id is required in a tool message "
                                          "(the id of the call it answers)")
            if not turns or turns[-1].role != "user":  # a run of user and tool messages is one turn
                turns.append(Turn("user"))
            turns[-1].parts.append((call_id, content))
        else:
            turns.append(Turn(role, content, reasoning, calls))
    order: dict[str, int] = {}  # call id -> its place among the latest assistant calls
    for t in turns:
        if t.calls:
            order = {c.id: k for k, c in enumerate(t.calls) if c.id}
        if t.role == "user":
            results = sorted((p for p in t.parts if p[0] is not None), key=lambda p: order.get(p[0], 0))
            t.parts = [p if p[0] is None else results.pop(0) for p in t.parts]
            t.content = "\n\n".join(text if call_id is None else f"<tool_result>{text}</tool_result>"
                                    for call_id, text in t.parts)
    return turns


def _offered(tools, tool_choice) -> list[dict]:
    """The function definitions the prompt lists: all of `tools`, the one a named `tool_choice`
    picks, or none for "none"."""
    forced = _forced_name(tool_choice)
    if tools is None:
        if forced is not None:
            raise ChatFormatError("tool_choice asks for a tool call, but the request defines no tools", "tool_choice")
        return []
    if not isinstance(tools, list) or not tools:
        raise ChatFormatError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                              "tools")
    functions = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ChatFormatError(f"tools[{j}].type must be 'function' (the only tool type served here)", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError(f"tools[{j}].function must be an object with a non-empty 'name'", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ChatFormatError(f"tools[{j}].function.parameters must be a JSON Schema object", "tools")
        if not isinstance(function.get("description", ""), str):
            raise ChatFormatError(f"tools[{j}].function.description must be a string", "tools")
        if any(f["name"] == function["name"] for f in functions):
            raise ChatFormatError(f"tools[{j}]: a second tool named '{function['name']}'", "tools")
        functions.append(function)
    if tool_choice == "none":
        return []
    if forced:
        functions = [f for f in functions if f["name"] == forced]
        if not functions:
            raise ChatFormatError(f"tool_choice names '{forced}', which is not among the tools", "tool_choice")
    return functions


def _forced_name(tool_choice) -> str | None:
    """The tool a tool_choice forces ("" for any one, "required"), None where none is forced."""
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return "" if tool_choice == "required" else None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(function, dict) or tool_choice.get("type") != "function"
            or not isinstance(function.get("name"), str) or not function["name"]):
        raise ChatFormatError("tool_choice must be \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return function["name"]


def _call_opening(tool_choice) -> str:
    """The start of a reply that calls the tool `tool_choice` forces: DeepSeek's encoding has no
    way to ask for a call, so the prompt writes the call's first tags (the name too, when named)."""
    forced = _forced_name(tool_choice)
    if forced is None:
        return ""
    return f'\n\n{CALLS_OPEN}\n{INVOKE_OPEN} name="' + (f'{forced}">\n' if forced else "")


def encode_tool_calls(calls: list[ToolCall]) -> str:
    """An assistant turn's calls as the DSML block that follows its text."""
    def parameter(key, value):
        flag, text = ("true", value) if isinstance(value, str) else ("false", _json(value))
        return f'{PARAM_OPEN} name="{key}" string="{flag}">{text}{PARAM_CLOSE}'

    invokes = [f'{INVOKE_OPEN} name="{c.name}">\n' + "\n".join(parameter(k, v) for k, v in c.arguments.items())
               + f"\n{INVOKE_CLOSE}" for c in calls]
    return f"\n\n{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def reasoning_budget(effort: str | int | None) -> int:
    """The numeric reasoning effort (1..100) for a name, a number, or None (the default)."""
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, str) and effort in EFFORT_NAMES:
        return EFFORT_NAMES[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ChatFormatError(f"reasoning_effort must be an integer 1..100 or one of {', '.join(EFFORT_NAMES)}; "
                          f"got {effort!r}", "reasoning_effort")


def encode_chat(messages, thinking: bool = False, reasoning_effort: str | int | None = None,
                add_generation_prompt: bool = True, tools: list | None = None, tool_choice=None) -> str:
    """The prompt text for a conversation: OpenAI-style messages (system, user, assistant with
    `reasoning_content` and `tool_calls`, tool with `tool_call_id`), `tools` (OpenAI function
    tools) and `tool_choice` ("auto", "none": tools not shown, "required" or a named function:
    the prompt ends inside the call's opening tags; not in thinking mode)."""
    turns = _turns(messages)
    functions = _offered(tools, tool_choice)
    opening = _call_opening(tool_choice) if functions else ""
    if opening and thinking:
        raise ChatFormatError("a tool_choice that forces a tool call is not available in thinking mode "
                              "(the reasoning comes before any call); use \"auto\"", "tool_choice")
    if functions and turns[0].role != "system":
        turns.insert(0, Turn("system"))
    keep_reasoning = bool(functions)  # with tools, no turn's reasoning is dropped
    last_user = max((i for i, t in enumerate(turns) if t.role == "user" or (t.role == "system" and i > 0)),
                    default=-1)
    out = [BOS]
    if thinking:
        out.append(SYSTEM + f"Reasoning Effort: {reasoning_budget(reasoning_effort)} (range 1-100, the higher "
                            "the value, the more thorough the reasoning)\n\n")
    elif reasoning_effort is not None:
        raise ChatFormatError("reasoning_effort applies to thinking mode only", "reasoning_effort")
    for i, t in enumerate(turns):
        if t.role == "system":
            text = t.content
            if i == 0 and functions:
                text += "\n\n" + TOOLS_SECTION.format(schemas="\n".join(_json(f) for f in functions))
            out.append(text if i == 0 and thinking else SYSTEM + text)
        elif t.role == "user":
            out.append(USER + t.content)
        else:
            keeps = thinking and (keep_reasoning or i > last_user)
            calls = encode_tool_calls(t.calls) if t.calls else ""
            out.append((t.reasoning + THINK_CLOSE if keeps else "") + t.content + calls + EOS)
        hands_over = t.role == "user" or (t.role == "system" and i > 0)
        next_role = turns[i + 1].role if i + 1 < len(turns) else None
        if hands_over and (next_role == "assistant" or (next_role is None and add_generation_prompt)):
            opens = thinking and (keep_reasoning or i >= last_user)
            out.append(ASSISTANT + (THINK_OPEN if opens else THINK_CLOSE))
    if add_generation_prompt:
        out.append(opening)
    return "".join(out)


# ------------------------------------------------------------------ replies

class _Malformed(ValueError):
    pass


def parse_tool_calls(block: str) -> list[ToolCall]:
    """The calls of a DSML block: `block` runs from `<｜DSML｜ calls>` to the reply's end (only
    whitespace may follow the closing tag). Raises ValueError where it is not exactly the format
    `encode_tool_calls` writes, holds no call, or a `string="false"` value is not JSON."""
    pos = 0

    def take(s):
        nonlocal pos
        if not block.startswith(s, pos):
            raise _Malformed(f"expected {s!r} at {pos}")
        pos += len(s)

    def until(s):
        nonlocal pos
        end = block.find(s, pos)
        if end < 0:
            raise _Malformed(f"no {s!r} after {pos}")
        found, pos = block[pos:end], end + len(s)
        return found

    def no_constants(name):
        raise _Malformed(f"{name} is not JSON")

    take(CALLS_OPEN + "\n")
    calls = []
    while not block.startswith(CALLS_CLOSE, pos):
        take(f'{INVOKE_OPEN} name="')
        name = until('">\n')
        arguments = {}
        if block.startswith("\n" + INVOKE_CLOSE, pos):  # no parameters
            pos += 1
        while not block.startswith(INVOKE_CLOSE, pos):
            take(f'{PARAM_OPEN} name="')
            key, flag = until('" string="'), until('">')
            value = until(PARAM_CLOSE)
            take("\n")
            if not key or '"' in key or key in arguments or flag not in ("true", "false"):
                raise _Malformed(f"parameter {key!r} of {name!r}")
            arguments[key] = value if flag == "true" else json.loads(value, parse_constant=no_constants)
        take(INVOKE_CLOSE + "\n")
        if not name or '"' in name or "\n" in name:
            raise _Malformed(f"tool name {name!r}")
        calls.append(ToolCall(name, arguments))
    take(CALLS_CLOSE)
    if not calls or block[pos:].strip():
        raise _Malformed("no call, or text after the block")
    return calls


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class ReplyParser:
    """Splits a reply, fed piece by piece as it streams, into reasoning, text and tool calls.

    `feed` returns the ("reasoning" | "content", text) pieces that are certain so far: text that
    could still be the start of `</think>` or of a call block is held back. In thinking mode
    everything before `</think>` is reasoning. With tools offered, a `<｜DSML｜ calls>` block ends
    the text (the blank line the encoder puts before it is dropped) and is parsed at `close`.
    """

    def __init__(self, thinking: bool = False, tools: list | None = None, tool_choice=None,
                 parallel: bool = True):
        self.reasoning = thinking
        self.calls_on = bool(tools) and tool_choice != "none"
        self.parallel = parallel
        self.pending = _call_opening(tool_choice) if self.calls_on else ""
        self.block: str | None = None  # the call block's raw text, once it has started
        self.blank = ""  # the blank line before the block

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.block is not None:
            self.block += text
            return []
        self.pending += text
        return self._drain(final=False)

    def close(self) -> tuple[list[tuple[str, str]], list[ToolCall] | None]:
        """The pieces left and the reply's tool calls (None if it calls none). A malformed
        block comes back as text, exactly as the model wrote it."""
        out = self._drain(final=True)
        if self.block is None:
            return out, None
        try:
            calls = parse_tool_calls(self.block)
        except ValueError:
            return out + [("content", self.blank + self.block)], None
        return out, calls if self.parallel else calls[:1]

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out = []
        if self.reasoning:
            end = self.pending.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else _held(self.pending, (THINK_CLOSE,))
                out.append(("reasoning", self.pending[: len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep:]
                return [p for p in out if p[1]]
            out.append(("reasoning", self.pending[:end]))
            self.pending, self.reasoning = self.pending[end + len(THINK_CLOSE):], False
        start = self.pending.find(CALLS_OPEN) if self.calls_on else -1
        if start >= 0:
            text = self.pending[:start]
            self.blank = "\n\n" if text.endswith("\n\n") else ""
            out.append(("content", text[: len(text) - len(self.blank)]))
            self.block, self.pending = self.pending[start:], ""
        else:
            keep = 0 if final or not self.calls_on else _held(self.pending, ("\n\n" + CALLS_OPEN, CALLS_OPEN))
            out.append(("content", self.pending[: len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
        return [p for p in out if p[1]]
