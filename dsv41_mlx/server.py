"""An OpenAI- and Anthropic-compatible HTTP server.

    python -m dsv41_mlx.server                        # the embedded default
    python -m dsv41_mlx.server --model deepseek-ai/DeepSeek-V4.1-Flash --port 8080
    mlx.launch -n 2 --backend ring -- python -m dsv41_mlx.server  # the layers split over 2 processes

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with
"stream": true for server-sent events), POST /v1/messages (Anthropic's Messages
API, streamed or not), GET /v1/models, GET /health.

Per request: seed, temperature, top_p, top_k, max_tokens, stop, and the
drafting controls draft (false turns it off), verify, confidence; chat adds
thinking, reasoning_effort, tools, tool_choice and parallel_tool_calls, and a
stream stream_options.include_usage. Tools and tool results are rendered in
DeepSeek-V4.1's DSML format and the model's DSML calls parsed back (chat.py);
/v1/messages maps Anthropic's blocks onto the same encoding. Responses carry
usage and, when drafting, the drafting stats. Requests wait in one queue and
run one at a time on a single worker thread, so a reply is exactly what the
same request would get alone. Bad requests get an HTTP 4xx JSON error that
names the problem, in each API's own error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import resource
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import mlx.core as mx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .chat import EMPTY_PROMPT, ChatFormatError, ReplyParser, encode_chat
from .generate import stream_generate, warm_up
from .runtime.prefix_cache import PrefixCache
from .runtime.runner import Runner
from .sampling import SamplingParams
from .speculative import VERIFY_MODES, ConfidencePolicy, resolve_verify

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
# OpenAI fields we do not implement, accepted only at the value that means "off"
NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, False),
           "top_logprobs": (None, 0), "logit_bias": (None, {}), "user": None,
           "response_format": (None, {"type": "text"}), "echo": (None, False), "best_of": (None, 1),
           "suffix": (None, "")}
DRAFTING = {"seed", "draft", "verify", "confidence"}  # this server's own fields, on every endpoint
ANTHROPIC_ERRORS = {404: "not_found_error", 500: "api_error"}  # any other 4xx: invalid_request_error


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": "invalid_request_error",
                                       "param": self.param, "code": self.code}}, status_code=self.status)

    def anthropic_response(self) -> JSONResponse:
        kind = ANTHROPIC_ERRORS.get(self.status, "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": self.message}},
                            status_code=self.status)


# ------------------------------------------------------------------ requests

@dataclass
class Job:
    """One request: what to generate, how to read the reply, and where the pieces go."""

    ids: list[int]
    options: dict
    stop: list[str]
    thinking: bool = False
    tools: list | None = None  # OpenAI function tools, as the prompt was encoded with them
    tool_choice: str | dict | None = None
    parallel: bool = True  # false: a reply keeps only its first tool call
    stream: bool = False
    include_usage: bool = False
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def parser(self) -> ReplyParser:
        return ReplyParser(self.thinking, self.tools, self.tool_choice, self.parallel)


def _field(body: dict, name: str, types, default, check=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RequestError(400, f"'{name}' must be {what}, got a boolean", name)
    if not isinstance(value, types):
        raise RequestError(400, f"'{name}' must be {what}, got {type(value).__name__} {json.dumps(value)[:40]}", name)
    if check is not None and not check(value):
        raise RequestError(400, f"'{name}' must be {what}, got {json.dumps(value)[:40]}", name)
    return value


def _check_fields(body, known: set[str], neutral: dict) -> None:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in neutral:
            allowed = neutral[name]
            if allowed is not None and value not in allowed:
                raise RequestError(400, f"'{name}' = {json.dumps(value)[:40]} is not supported by this server", name)
        elif name not in known:
            raise RequestError(400, f"unknown field '{name}'", name)


def _check_model(body: dict, served: str) -> None:
    model = _field(body, "model", str, served, what="a string")
    if model != served:
        raise RequestError(404, f"model '{model}' is not served here; this server serves '{served}'", "model",
                           "model_not_found")


def _encode(tokenizer, messages, **kwargs) -> list[int]:
    try:
        return tokenizer.encode(encode_chat(messages, **kwargs))
    except ChatFormatError as e:
        raise RequestError(400, str(e), e.param) from None


def _options(body: dict, ids: list[int], context: int, prompt_param: str, max_name: str, temperature_max: int,
             stop_name: str, stop_limit: int | None) -> tuple[dict, list[str]]:
    """The generation options and stop strings of a request whose prompt is `ids`."""
    if not ids:
        raise RequestError(400, EMPTY_PROMPT, prompt_param)
    if len(ids) >= context:
        raise RequestError(400, f"the prompt is {len(ids)} tokens; this model's context is {context} tokens",
                           prompt_param, "context_length_exceeded")
    room = context - len(ids)
    max_tokens = _field(body, max_name, int, min(DEFAULT_MAX_TOKENS, room), lambda v: 1 <= v <= room,
                        f"an integer from 1 to {room} (the context left after the {len(ids)}-token prompt)")
    options = {
        "max_tokens": max_tokens,
        "temperature": float(_field(body, "temperature", (int, float), 0.0, lambda v: 0 <= v <= temperature_max,
                                    f"a number from 0 to {temperature_max}")),
        "top_p": float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        "top_k": _field(body, "top_k", int, 0, lambda v: v >= 0, "a non-negative integer"),
        "seed": _field(body, "seed", int, 0, lambda v: 0 <= v < 2**31, "an integer from 0 to 2**31 - 1"),
        "draft": _field(body, "draft", bool, None, what="true or false"),
        "verify": _field(body, "verify", str, None, lambda v: v in VERIFY_MODES,
                         f"one of {', '.join(VERIFY_MODES)}"),
        "confidence": _field(body, "confidence", str, None, what="off, threshold:X or schedule"),
    }
    if options["draft"] is False and (options["verify"] or options["confidence"]):
        raise RequestError(400, "'verify' and 'confidence' apply to drafting, which this request turns off", "draft")
    if options["confidence"] is not None:
        try:
            ConfidencePolicy.parse(options["confidence"])
        except ValueError as e:
            raise RequestError(400, str(e), "confidence") from None
    try:
        params = SamplingParams(options["temperature"], options["top_p"], options["top_k"], options["seed"])
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    try:
        resolve_verify(options["verify"], params)
    except ValueError as e:
        raise RequestError(400, str(e), "verify") from None
    stop = body.get(stop_name)
    if stop is None:
        stop = []
    elif isinstance(stop, str) and stop_limit is not None:
        stop = [stop]
    if (not isinstance(stop, list) or (stop_limit is not None and len(stop) > stop_limit)
            or not all(isinstance(s, str) and s for s in stop)):
        what = f"a non-empty string or a list of up to {stop_limit} of them" if stop_limit else "a list of non-empty strings"
        raise RequestError(400, f"'{stop_name}' must be {what}", stop_name)
    return options, stop


def _include_usage(body: dict, stream: bool) -> bool:
    """stream_options.include_usage; like OpenAI, stream_options without streaming is an error."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    if (not isinstance(options, dict) or set(options) - {"include_usage"}
            or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(400, "'stream_options' must be {\"include_usage\": true or false}", "stream_options")
    return options.get("include_usage", False)


def parse_request(body, kind: str, served: str, tokenizer, context: int) -> Job:
    """Validate an OpenAI chat or completion request body; every problem is a RequestError naming the field."""
    known = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "stream",
             "stream_options"} | DRAFTING
    known |= ({"messages", "thinking", "reasoning_effort", "tools", "tool_choice", "parallel_tool_calls"}
              if kind == "chat" else {"prompt"})
    _check_fields(body, known, NEUTRAL)
    _check_model(body, served)
    stream = _field(body, "stream", bool, False, what="true or false")
    job = Job([], {}, [], stream=stream, include_usage=_include_usage(body, stream))
    if kind == "chat":
        job.thinking = _field(body, "thinking", bool, False, what="true or false")
        job.tools, job.tool_choice = body.get("tools"), body.get("tool_choice")
        job.parallel = _field(body, "parallel_tool_calls", bool, True, what="true or false")
        job.ids = _encode(tokenizer, body.get("messages"), thinking=job.thinking,
                          reasoning_effort=body.get("reasoning_effort"), tools=job.tools, tool_choice=job.tool_choice)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            job.ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and 0 <= t < tokenizer.vocab_size for t in prompt):
            job.ids = list(prompt)
        else:
            raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    job.options, job.stop = _options(body, job.ids, context, "messages" if kind == "chat" else "prompt", max_name,
                                     2, "stop", 4)
    return job


# --------------------------------------------------- Anthropic's Messages API

def _anthropic_text(content, where: str) -> str:
    """A string, or a list of text blocks (joined by a blank line, as the encoder joins parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise RequestError(400, f"{where}[{j}]: only text blocks are supported here", where.split("[")[0])
            texts.append(block["text"])
        return "\n\n".join(texts)
    raise RequestError(400, f"{where} must be a string or a list of text blocks", where.split("[")[0])


def _string(block: dict, key: str, where: str, empty_ok: bool = False) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not (value or empty_ok):
        raise RequestError(400, f"{where}.{key} must be a {'' if empty_ok else 'non-empty '}string", "messages")
    return value


def _anthropic_messages(body: dict) -> list[dict]:
    """Anthropic messages (and system) as the OpenAI-style messages chat.py encodes: a user
    message's tool_result blocks become tool messages, an assistant's tool_use blocks its
    tool_calls and its thinking blocks its reasoning_content."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _anthropic_text(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(400, f"{at} must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(400, f"{at}.content must be a string or a list of content blocks", "messages")
        kinds = ("text", "tool_result") if m["role"] == "user" else ("text", "thinking", "tool_use")
        found = {kind: [] for kind in kinds}
        for j, block in enumerate(blocks):
            where = f"{at}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in kinds:
                raise RequestError(400, f"{where}.type must be one of {', '.join(kinds)} in a {m['role']} message; "
                                        f"got {kind!r}", "messages")
            if kind == "text" and m["role"] == "user":  # in order among the tool results, as the encoder joins them
                out.append({"role": "user", "content": _string(block, "text", where, empty_ok=True)})
            elif kind == "text":
                found[kind].append(_string(block, "text", where, empty_ok=True))
            elif kind == "thinking":
                found[kind].append(_string(block, "thinking", where, empty_ok=True))
            elif kind == "tool_use":
                if not isinstance(block.get("input"), dict):
                    raise RequestError(400, f"{where}.input must be an object", "messages")
                found[kind].append({"id": _string(block, "id", where), "type": "function",
                                    "function": {"name": _string(block, "name", where),
                                                 "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            else:
                out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                            "content": _anthropic_text(block.get("content", ""), f"{where}.content")})
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "\n\n".join(found["text"]),
                        "reasoning_content": "".join(found["thinking"]), "tool_calls": found["tool_use"]})
        elif not blocks:
            out.append({"role": "user", "content": ""})
    if messages[-1].get("role") != "user":
        raise RequestError(400, "the last message must be a user message (continuing a partly written assistant "
                                "reply is not supported)", "messages")
    return out


def _anthropic_tools(body: dict) -> tuple[list | None, str | dict | None, bool]:
    """Anthropic tools and tool_choice as OpenAI function tools and tool_choice, and whether
    parallel calls are allowed."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(400, "'tools' must be a list", "tools")
        functions = []
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise RequestError(400, f"tools[{j}]: only custom tools (name, description, input_schema) are "
                                        "served here", "tools")
            if not isinstance(tool.get("name"), str) or not tool["name"] or not isinstance(tool.get("input_schema"),
                                                                                          dict):
                raise RequestError(400, f"tools[{j}] must have a non-empty 'name' and an 'input_schema' object",
                                   "tools")
            function = {"name": tool["name"]}
            if "description" in tool:
                function["description"] = tool["description"]
            function["parameters"] = tool["input_schema"]
            functions.append({"type": "function", "function": function})
        tools = functions or None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
        raise RequestError(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                                "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    parallel = not _field(choice, "disable_parallel_tool_use", bool, False, what="true or false")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {"type": "function",
                                                                             "function": {"name": choice["name"]}}
    return tools, mapped, parallel


def _anthropic_thinking(body: dict, max_tokens: int) -> bool:
    """Anthropic's thinking setting as V4.1's thinking mode. budget_tokens must be below max_tokens,
    as Anthropic requires, but does not steer the reply: V4.1 reasons at an effort level (the
    default, high), not to a token budget."""
    thinking = body.get("thinking")
    if thinking is None or thinking == {"type": "disabled"}:
        return False
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if (not isinstance(thinking, dict) or thinking.get("type") != "enabled" or set(thinking) - {"type", "budget_tokens"}
            or not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < max_tokens):
        raise RequestError(400, "'thinking' must be {\"type\": \"disabled\"} or {\"type\": \"enabled\", "
                                "\"budget_tokens\": N} with N from 1 to max_tokens - 1", "thinking")
    return True


def parse_messages_request(body, served: str, tokenizer, context: int) -> Job:
    """Validate an Anthropic Messages request body; every problem is a RequestError naming the field."""
    known = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
             "stream", "tools", "tool_choice", "thinking", "metadata"} | DRAFTING
    _check_fields(body, known, {})
    for required in ("model", "max_tokens"):
        if body.get(required) is None:
            raise RequestError(400, f"'{required}' is required", required)
    _check_model(body, served)
    max_tokens = _field(body, "max_tokens", int, None, lambda v: v >= 1, "a positive integer")
    job = Job([], {}, [], stream=_field(body, "stream", bool, False, what="true or false"))
    job.thinking = _anthropic_thinking(body, max_tokens)
    job.tools, job.tool_choice, job.parallel = _anthropic_tools(body)
    job.ids = _encode(tokenizer, _anthropic_messages(body), thinking=job.thinking, tools=job.tools,
                      tool_choice=job.tool_choice)
    job.options, job.stop = _options(body, job.ids, context, "messages", "max_tokens", 1, "stop_sequences", None)
    return job


# -------------------------------------------------------------------- engine

class Engine:
    """One worker thread runs the queued jobs in order, one at a time, through one Runner kept for
    the server's life (its evaluator thread and stream are made once, not per request). So the
    requests' forwards all come from that thread, in order, as a PipelineRunner's messages must."""

    def __init__(self, model, tokenizer, name: str, runner: Runner | None = None,
                 prompt_cache: PrefixCache | None = None):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.runner = runner if runner is not None else Runner(model)
        self.prompt_cache = prompt_cache  # states of earlier prompts and replies a request resumes from
        self.context = model.args.max_position_embeddings or 2**31
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.served = 0
        self.abandoned = 0  # jobs stopped because their client went away
        self.worker = threading.Thread(target=self._work, name="dsv41-engine", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> None:
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        self.jobs.put(job)

    def drain(self) -> None:
        """Wait until every job queued is done (one whose client is gone: skipped). The worker stays,
        idle: a thread that ran generations and ends as the process exits may abort it (MLX's teardown)."""
        self.jobs.join()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            except Exception as e:  # a bug must not take the server down; the client hears about it
                log.exception("request failed")
                job.emit(("error", f"generation failed: {e}"))
            finally:
                self.served += 1
                self.jobs.task_done()

    def _run(self, job: Job) -> None:
        """Emits ("text", piece)... then ("done", finish, usage, drafting stats, the stop string that ended it)."""
        text, sent, finish, stats, n, matched, cached = "", 0, "length", None, 0, None, 0
        hold = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming
        for r in stream_generate(self.model, self.tokenizer, job.ids, runner=self.runner,
                                 prompt_cache=self.prompt_cache, **job.options):
            if job.cancelled.is_set():
                log.info("client went away: generation stopped after %d tokens", r.generation_tokens)
                self.abandoned += 1
                return
            n, stats, cached = r.generation_tokens, r.draft_stats, r.cached_tokens
            text += r.text
            cut, matched = min(((text.find(s), s) for s in job.stop if s in text), default=(-1, None))
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            if r.finish_reason:
                finish = r.finish_reason
                break
            if len(text) - hold > sent:
                job.emit(("text", text[sent: len(text) - hold]))
                sent = len(text) - hold
        if len(text) > sent:
            job.emit(("text", text[sent:]))
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        job.emit(("done", finish, usage, stats.as_dict() if stats is not None else None, matched))

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "queued": self.jobs.qsize(), "served": self.served,
                "abandoned": self.abandoned,
                "active_memory_gb": mx.get_active_memory() / 1e9,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                                     else 1024) / 1e9,
                "prompt_cache": self._prompt_cache_health()}

    def _prompt_cache_health(self) -> dict | None:
        pc = self.prompt_cache
        if pc is None:
            return None
        return {"entries": len(pc), "bytes": pc.nbytes, "max_bytes": pc.max_bytes, "hits": pc.hits,
                "misses": pc.misses, "by_entry": pc.entries()}


# ---------------------------------------------------------------------- http

def _sse(payload: dict, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(payload)}\n\n"


def _joined(pieces: list[tuple[str, str]], kind: str) -> str:
    return "".join(text for k, text in pieces if k == kind)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _openai_calls(calls) -> list[dict]:
    return [{"id": _new_id("call_"), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json()}} for c in calls]


def _stop_reason(finish: str, calls, matched: str | None) -> str:
    if calls:
        return "tool_use"
    return "max_tokens" if finish == "length" else "stop_sequence" if matched is not None else "end_turn"


def create_app(engine: Engine) -> Starlette:
    async def body_of(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})") from None

    async def reply(job: Job):
        """The whole reply: the parser's pieces, the tool calls and the last event ("done" or "error")."""
        parser, pieces = job.parser(), []
        try:
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    pieces += parser.feed(event[1])
                else:
                    break
        finally:
            job.cancelled.set()  # nothing left to do, or the client is gone
        rest, calls = parser.close()
        return pieces + rest, calls, event

    async def completions(request: Request, kind: str):
        try:
            job = parse_request(await body_of(request), kind, engine.name, engine.tokenizer, engine.context)
        except RequestError as e:
            return e.response()
        rid = _new_id("chatcmpl-" if kind == "chat" else "cmpl-")
        created = int(time.time())
        engine.submit(job)
        if job.stream:
            return StreamingResponse(openai_events(job, kind, rid, created), media_type="text/event-stream")
        pieces, calls, event = await reply(job)
        if event[0] == "error":
            return JSONResponse({"error": {"message": event[1], "type": "server_error"}}, status_code=500)
        _, finish, usage, stats, _ = event
        if kind == "chat":
            content = _joined(pieces, "content")
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if job.thinking:
                message["reasoning_content"] = _joined(pieces, "reasoning")
            if calls:
                message["tool_calls"] = _openai_calls(calls)
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish}
        else:
            choice = {"index": 0, "text": _joined(pieces, "content"), "finish_reason": finish}
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": created, "model": engine.name, "choices": [choice], "usage": usage,
                             "drafting": stats})

    async def openai_events(job: Job, kind: str, rid: str, created: int):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        delta_key = {"content": "content", "reasoning": "reasoning_content"}

        def chunk(choices: list, **extra) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": engine.name, "choices": choices}
            if job.include_usage:
                payload["usage"] = None  # as OpenAI: null on every chunk but the last
            return _sse({**payload, **extra})

        def choice(delta: dict | None = None, text: str = "", finish=None) -> dict:
            if kind == "chat":
                return {"index": 0, "delta": delta or {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        parser = job.parser()
        try:
            if kind == "chat":
                yield chunk([choice({"role": "assistant"})])
            while True:
                event = await job.events.get()
                if event[0] == "error":
                    yield _sse({"error": {"message": event[1], "type": "server_error"}})
                    break
                pieces, calls = (parser.feed(event[1]), None) if event[0] == "text" else parser.close()
                for k, text in pieces:
                    yield chunk([choice({delta_key[k]: text}, text)])
                if event[0] == "text":
                    continue
                _, finish, usage, stats, _ = event
                for i, call in enumerate(_openai_calls(calls or [])):
                    yield chunk([choice({"tool_calls": [{"index": i, **call}]})])
                yield chunk([choice(finish="tool_calls" if calls else finish)], drafting=stats)
                if job.include_usage:
                    yield chunk([], usage=usage)
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # on a client disconnect the worker stops at its next token

    async def messages_route(request: Request):
        try:
            job = parse_messages_request(await body_of(request), engine.name, engine.tokenizer, engine.context)
        except RequestError as e:
            return e.anthropic_response()
        mid = _new_id("msg_")
        engine.submit(job)
        if job.stream:
            return StreamingResponse(anthropic_events(job, mid), media_type="text/event-stream")
        pieces, calls, event = await reply(job)
        if event[0] == "error":
            return RequestError(500, event[1]).anthropic_response()
        _, finish, usage, stats, matched = event
        content = []
        if _joined(pieces, "reasoning"):
            content.append({"type": "thinking", "thinking": _joined(pieces, "reasoning"), "signature": ""})
        if _joined(pieces, "content"):
            content.append({"type": "text", "text": _joined(pieces, "content")})
        content += [{"type": "tool_use", "id": _new_id("toolu_"), "name": c.name, "input": c.arguments}
                    for c in calls or []]
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": engine.name,
                             "content": content, "stop_reason": _stop_reason(finish, calls, matched),
                             "stop_sequence": matched,
                             "usage": {"input_tokens": usage["prompt_tokens"],
                                       "output_tokens": usage["completion_tokens"],
                                       "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                             "drafting": stats})

    async def anthropic_events(job: Job, mid: str):
        """Anthropic's event stream: message_start, each content block (start, deltas, stop),
        message_delta (stop reason, usage), message_stop."""
        blocks = {"reasoning": ("thinking", "thinking_delta", "thinking"), "content": ("text", "text_delta", "text")}
        parser, index, open_kind = job.parser(), -1, None

        def start(block: dict) -> str:
            nonlocal index
            index += 1
            return _sse({"type": "content_block_start", "index": index, "content_block": block},
                        "content_block_start")

        def stop() -> str:
            return _sse({"type": "content_block_stop", "index": index}, "content_block_stop")

        try:
            yield _sse({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": engine.name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(job.ids), "output_tokens": 0}}}, "message_start")
            while True:
                event = await job.events.get()
                if event[0] == "error":
                    yield _sse({"type": "error", "error": {"type": "api_error", "message": event[1]}}, "error")
                    break
                pieces, calls = (parser.feed(event[1]), None) if event[0] == "text" else parser.close()
                for k, text in pieces:
                    block, delta, key = blocks[k]
                    if open_kind != k:
                        if open_kind is not None:
                            yield stop()
                        yield start({"type": block, key: "", **({"signature": ""} if block == "thinking" else {})})
                        open_kind = k
                    yield _sse({"type": "content_block_delta", "index": index, "delta": {"type": delta, key: text}},
                               "content_block_delta")
                if event[0] == "text":
                    continue
                if open_kind is not None:
                    yield stop()
                for call in calls or []:
                    yield start({"type": "tool_use", "id": _new_id("toolu_"), "name": call.name, "input": {}})
                    yield _sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": call.arguments_json()}},
                               "content_block_delta")
                    yield stop()
                _, finish, usage, stats, matched = event
                yield _sse({"type": "message_delta",
                            "delta": {"stop_reason": _stop_reason(finish, calls, matched), "stop_sequence": matched},
                            "usage": {"output_tokens": usage["completion_tokens"]}, "drafting": stats},
                           "message_delta")
                yield _sse({"type": "message_stop"}, "message_stop")
                break
        finally:
            job.cancelled.set()

    async def chat_route(request: Request):
        return await completions(request, "chat")

    async def completion_route(request: Request):
        return await completions(request, "completion")

    async def models_route(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                                         "owned_by": "dsv41_mlx"}]})

    async def health_route(request: Request):
        return JSONResponse(engine.health())

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", completion_route, methods=["POST"]),
        Route("/v1/messages", messages_route, methods=["POST"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/health", health_route, methods=["GET"]),
    ])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .config import ConfigError
    from .io.checkpoint import CheckpointError
    from .io.load import load_launched
    from .runtime.pipeline import Link, add_split_argument, launched_group, launched_runner, serve

    parser = argparse.ArgumentParser(prog="python -m dsv41_mlx.server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: embedded tiny model)")
    parser.add_argument("--name", help="the model name clients use (default: --model, or dsv41-tiny)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    parser.add_argument("--prompt-cache-gb", type=float, default=4.0,
                        help="memory for the states of earlier prompts and replies that a request whose tokens "
                             "begin with them resumes from (least recently used dropped first); 0: off. Across "
                             "the ranks of mlx.launch it counts rank 0's part; each rank keeps its own layers' part")
    parser.add_argument("--warm-up", action="store_true",
                        help="before serving, run every request shape once (on CUDA each GPU kernel's first use in a "
                             "process costs seconds, which would otherwise fall on the first requests)")
    add_split_argument(parser)
    args = parser.parse_args(argv)
    if args.prompt_cache_gb < 0:
        parser.error(f"argument --prompt-cache-gb: must be >= 0, got {args.prompt_cache_gb}")
    group = launched_group(parser, args.pipeline_split)  # under mlx.launch: one rank of a pipeline
    quiet = args.quiet or group.rank() > 0  # the other ranks log nothing but warnings
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    try:
        model, tokenizer = load_launched(args.model, group, args.pipeline_split, progress=not quiet)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if group.rank() > 0:
        # a Ctrl-C reaches every rank; these leave at rank 0's STOP, once it has shut down
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve(model, Link(group))
        return 0
    with launched_runner(model, group) as runner:  # closing a PipelineRunner stops the other ranks
        if runner.drafter is not None and runner.drafter.head == "fp8":
            runner.drafter.build_fp8_head(progress=not quiet)
        if args.warm_up:
            log.info("warm-up: every request shape once, %.1f s", warm_up(runner))
        gb = args.prompt_cache_gb
        prompt_cache = PrefixCache.for_chat(int(gb * 1e9), tokenizer) if gb else None
        engine = Engine(model, tokenizer, args.name or args.model or "dsv41-tiny", runner, prompt_cache)
        try:
            uvicorn.run(create_app(engine), host=args.host, port=args.port,
                        log_level="warning" if quiet else "info")
        finally:  # (on Ctrl-C too) the engine's last forward done before the runner closes
            engine.drain()
    return 0


if __name__ == "__main__":
    sys.exit(main())
