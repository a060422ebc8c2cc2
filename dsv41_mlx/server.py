"""An OpenAI-compatible HTTP server.

    python -m dsv41_mlx.server                        # the embedded default
    python -m dsv41_mlx.server --model deepseek-ai/DeepSeek-V4.1-Flash --port 8080

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with
"stream": true for server-sent events), GET /v1/models, GET /health.

Per request: seed, temperature, top_p, top_k, max_tokens, stop, and the
drafting controls draft (false turns it off), verify, confidence; chat adds
thinking and reasoning_effort. Responses carry usage and, when drafting, the
drafting stats. Requests wait in one queue and run one at a time on a single
worker thread, so a reply is exactly what the same request would get alone.
Bad requests get an HTTP 4xx JSON error that names the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import resource
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

from .chat import EMPTY_PROMPT, ChatFormatError, encode_chat
from .generate import stream_generate, warm_up
from .runtime.runner import Runner
from .sampling import SamplingParams
from .speculative import VERIFY_MODES, ConfidencePolicy, resolve_verify

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
# OpenAI fields we do not implement, accepted only at the value that means "off"
NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, False),
           "top_logprobs": (None, 0), "logit_bias": (None, {}), "user": None, "stream_options": None,
           "response_format": (None, {"type": "text"}), "echo": (None, False), "best_of": (None, 1),
           "suffix": (None, "")}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": "invalid_request_error",
                                       "param": self.param, "code": self.code}}, status_code=self.status)


# ------------------------------------------------------------------ requests

@dataclass
class Job:
    """One request: what to generate and where the pieces go."""

    ids: list[int]
    options: dict
    stop: list[str]
    thinking: bool = False
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


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


def parse_request(body, kind: str, served: str, tokenizer, context: int) -> Job:
    """Validate a chat or completion request body; every problem is a RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    known = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
             "stream", "draft", "verify", "confidence"}
    known |= {"messages", "thinking", "reasoning_effort"} if kind == "chat" else {"prompt"}
    for name, value in body.items():
        if name in NEUTRAL:
            allowed = NEUTRAL[name]
            if allowed is not None and value not in allowed:
                raise RequestError(400, f"'{name}' = {json.dumps(value)[:40]} is not supported by this server", name)
        elif name not in known:
            raise RequestError(400, f"unknown field '{name}'", name)
    model = _field(body, "model", str, served, what="a string")
    if model != served:
        raise RequestError(404, f"model '{model}' is not served here; this server serves '{served}'", "model",
                           "model_not_found")
    thinking = False
    if kind == "chat":
        thinking = _field(body, "thinking", bool, False, what="true or false")
        effort = body.get("reasoning_effort")
        try:
            text = encode_chat(body.get("messages"), thinking=thinking, reasoning_effort=effort)
        except ChatFormatError as e:
            param = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
            raise RequestError(400, str(e), param) from None
        ids = tokenizer.encode(text)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and 0 <= t < tokenizer.vocab_size for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")
    if not ids:
        raise RequestError(400, EMPTY_PROMPT, "prompt" if kind != "chat" else "messages")
    if len(ids) >= context:
        raise RequestError(400, f"the prompt is {len(ids)} tokens; this model's context is {context} tokens",
                           "messages" if kind == "chat" else "prompt", "context_length_exceeded")
    room = context - len(ids)
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _field(body, max_name, int, min(DEFAULT_MAX_TOKENS, room), lambda v: 1 <= v <= room,
                        f"an integer from 1 to {room} (the context left after the {len(ids)}-token prompt)")
    options = {
        "max_tokens": max_tokens,
        "temperature": float(_field(body, "temperature", (int, float), 0.0, lambda v: 0 <= v <= 2,
                                    "a number from 0 to 2")),
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
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return Job(ids, options, stop, thinking)


# -------------------------------------------------------------------- engine

class Engine:
    """One worker thread runs the queued jobs in order, one at a time, through one Runner kept for
    the server's life (its evaluator thread and stream are made once, not per request)."""

    def __init__(self, model, tokenizer, name: str, runner: Runner | None = None):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.runner = runner if runner is not None else Runner(model)
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

    def _run(self, job: Job) -> None:
        text, sent, finish, stats, n = "", 0, "length", None, 0
        hold = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming
        for r in stream_generate(self.model, self.tokenizer, job.ids, runner=self.runner, **job.options):
            if job.cancelled.is_set():
                log.info("client went away: generation stopped after %d tokens", r.generation_tokens)
                self.abandoned += 1
                return
            n, stats = r.generation_tokens, r.draft_stats
            text += r.text
            cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
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
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}
        job.emit(("done", finish, usage, stats.as_dict() if stats is not None else None))

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "queued": self.jobs.qsize(), "served": self.served,
                "abandoned": self.abandoned,
                "active_memory_gb": mx.get_active_memory() / 1e9,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                                     else 1024) / 1e9}


# ---------------------------------------------------------------------- http

def _split_thinking(text: str, thinking: bool) -> tuple[str | None, str]:
    """In thinking mode the reply is reasoning, '</think>', then the answer."""
    if thinking and "</think>" in text:
        reasoning, answer = text.split("</think>", 1)
        return reasoning, answer
    return None, text


def create_app(engine: Engine) -> Starlette:
    async def body_of(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})") from None

    async def completions(request: Request, kind: str):
        try:
            body = await body_of(request)
            job = parse_request(body, kind, engine.name, engine.tokenizer, engine.context)
            stream = _field(body, "stream", bool, False, what="true or false")
        except RequestError as e:
            return e.response()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        engine.submit(job)
        if stream:
            return StreamingResponse(_sse(job, kind, rid, created), media_type="text/event-stream")
        pieces = []
        try:
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "error":
                    return JSONResponse({"error": {"message": event[1], "type": "server_error"}}, status_code=500)
                else:
                    break
        finally:
            job.cancelled.set()  # nothing left to do, or the client is gone
        _, finish, usage, stats = event
        text = "".join(pieces)
        if kind == "chat":
            reasoning, answer = _split_thinking(text, job.thinking)
            message = {"role": "assistant", "content": answer}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": created, "model": engine.name, "choices": [choice], "usage": usage,
                             "drafting": stats})

    async def _sse(job: Job, kind: str, rid: str, created: int):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish=None, extra=None) -> str:
            if kind == "chat":
                delta = {} if delta_text is None else {"content": delta_text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": engine.name, "choices": [choice]}
            payload.update(extra or {})
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if kind == "chat":
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': engine.name, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n"
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    yield chunk(event[1])
                elif event[0] == "error":
                    yield f"data: {json.dumps({'error': {'message': event[1], 'type': 'server_error'}})}\n\n"
                    break
                else:
                    _, finish, usage, stats = event
                    yield chunk(None, finish, {"usage": usage, "drafting": stats})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # on a client disconnect the worker stops at its next token

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
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/health", health_route, methods=["GET"]),
    ])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .io.checkpoint import CheckpointError
    from .io.load import load
    from .config import ConfigError

    parser = argparse.ArgumentParser(prog="python -m dsv41_mlx.server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: embedded tiny model)")
    parser.add_argument("--name", help="the model name clients use (default: --model, or dsv41-tiny)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    parser.add_argument("--warm-up", action="store_true",
                        help="before serving, run every request shape once (on CUDA each GPU kernel's first use in a "
                             "process costs seconds, which would otherwise fall on the first requests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        model, tokenizer = load(args.model, progress=not args.quiet)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner = Runner(model)
    if runner.drafter is not None and runner.drafter.head == "fp8":
        runner.drafter.build_fp8_head(progress=not args.quiet)
    if args.warm_up:
        log.info("warm-up: every request shape once, %.1f s", warm_up(runner))
    engine = Engine(model, tokenizer, args.name or args.model or "dsv41-tiny", runner)
    uvicorn.run(create_app(engine), host=args.host, port=args.port,
                log_level="warning" if args.quiet else "info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
