"""The OpenAI-compatible server on the embedded default: replies, streaming, bad input, load."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

import dsv41_mlx
from dsv41_mlx.chat import encode_chat
from dsv41_mlx.generate import stream_generate
from dsv41_mlx.server import Engine, create_app


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = dsv41_mlx.load()
    return Engine(model, tokenizer, "dsv41-tiny")


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


@contextlib.contextmanager
def serving(app):
    """`app` on a real loopback socket; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(engine):
    """The app on a real loopback socket (for disconnects and concurrent clients)."""
    with serving(create_app(engine)) as url:
        yield url


def solo(engine, ids, **options) -> str:
    """What the same request gives when run directly, alone."""
    return "".join(r.text for r in stream_generate(engine.model, engine.tokenizer, ids, **options))


CHAT = [{"role": "user", "content": "Tell me about lighthouses."}]


# ---------------------------------------------------------------- replies

def test_models_and_health(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "dsv41-tiny"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "dsv41-tiny"


def test_a_second_turn_resumes_from_the_first_and_health_shows_the_cache(engine):
    """With a prompt cache, turn 2 (turn 1, its reply, a new question) prefills only what is
    new: usage says how many prompt tokens came from the cache, the reply is the one a cold
    prefill gives, and /health lists the cache's entries and their sizes."""
    from dsv41_mlx.runtime.prefix_cache import PrefixCache

    cached = Engine(engine.model, engine.tokenizer, "dsv41-tiny", engine.runner,
                    PrefixCache.for_chat(1 << 30, engine.tokenizer))
    with TestClient(create_app(cached)) as c:
        first = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5}).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        turn2 = CHAT + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And their keepers?"}]
        second = c.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 5}).json()
        ids = engine.tokenizer.encode(encode_chat(turn2))
        assert second["usage"]["prompt_tokens"] == len(ids)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > len(engine.tokenizer.encode(encode_chat(CHAT)))
        assert second["choices"][0]["message"]["content"] == solo(engine, ids, max_tokens=5)
        health = c.get("/health").json()["prompt_cache"]
    assert health["entries"] == len(health["by_entry"]) >= 2 and health["hits"] >= 1
    assert health["bytes"] == sum(e["bytes"] for e in health["by_entry"]) <= health["max_bytes"]


def test_on_the_gpus_schedule_a_cached_second_turn_streams_the_solo_reply(engine):
    """The server as it runs on a GPU (its Runner's forwards padded to 8 rows, started from the
    evaluator's thread, built ahead), on the CPU: a chat's second turn, streamed, drafted and
    not, resumes from the first turn's cached state and streams what a cold prefill replies."""
    from dsv41_mlx.runtime.options import Options
    from dsv41_mlx.runtime.prefix_cache import PrefixCache
    from dsv41_mlx.runtime.runner import Runner

    schedule = Options(decode_rows=8, overlap_build=True, evaluate_on_thread=True, build_ahead=True)
    for draft in (True, False):
        with Runner(engine.model, schedule) as runner:
            served = Engine(engine.model, engine.tokenizer, "dsv41-tiny", runner,
                            PrefixCache.for_chat(1 << 30, engine.tokenizer))
            with TestClient(create_app(served)) as c:
                request = {"max_tokens": 5, "seed": 4, "temperature": 0.8, "draft": draft}
                first = c.post("/v1/chat/completions", json={**request, "messages": CHAT}).json()
                turn2 = CHAT + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                {"role": "user", "content": "And their keepers?"}]
                stream = {**request, "messages": turn2, "stream": True, "stream_options": {"include_usage": True}}
                with c.stream("POST", "/v1/chat/completions", json=stream) as r:
                    events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
            served.drain()
        ids = engine.tokenizer.encode(encode_chat(turn2))
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert text == solo(engine, ids, max_tokens=5, seed=4, temperature=0.8)


def test_chat_completion_equals_the_solo_reply_and_reports_usage_and_drafting(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "seed": 3, "temperature": 0.9})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = engine.tokenizer.encode(encode_chat(CHAT))
    assert body["choices"][0]["message"]["content"] == solo(engine, ids, max_tokens=6, seed=3, temperature=0.9)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"
    drafting = body["drafting"]  # rounds, or plain steps where this (random) drafter has not paid
    assert drafting["rounds"] + drafting["plain_steps"] >= 1 and "acceptance_by_position" in drafting


def test_streamed_completion_concatenates_to_the_plain_one_and_ends_with_the_usage_asked_for(client):
    request = {"prompt": "Once upon a time", "max_tokens": 7, "seed": 5, "temperature": 0.7}
    plain = client.post("/v1/completions", json=request).json()
    stream = {**request, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    *chunks, last = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and all(c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"] == plain["usage"]


def test_draft_false_gives_the_same_reply_without_drafting_stats(client):
    request = {"prompt": [5, 6, 7, 8], "max_tokens": 5}
    drafted = client.post("/v1/completions", json=request).json()
    plain = client.post("/v1/completions", json={**request, "draft": False}).json()
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"]
    assert plain["drafting"] is None and drafted["drafting"] is not None


def test_stop_sequence_ends_the_reply_before_it(client, engine):
    full = solo(engine, [9, 10, 11], max_tokens=8)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop and stop in full
    body = client.post("/v1/completions", json={"prompt": [9, 10, 11], "max_tokens": 8, "stop": [stop]}).json()
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


# -------------------------------------------------------------- bad input

@pytest.mark.parametrize("path, payload, status, names", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "'temperature'"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "'top_p'"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, 400, "'stop'"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "'stream'"),
    ("/v1/chat/completions", {"messages": CHAT, "verify": "typical"}, 400, "'verify'"),
    ("/v1/chat/completions", {"messages": CHAT, "confidence": "sometimes"}, 400, "confidence"),
    ("/v1/chat/completions", {"messages": CHAT, "draft": False, "verify": "greedy"}, 400, "drafting"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "'gpt-4' is not served"),
    ("/v1/completions", {"prompt": [1] * 5000}, 400, "context is 4096 tokens"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "'stream_options' is only allowed when 'stream' is true"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "'stream_options' must be"),
])
def test_bad_requests_get_a_4xx_json_error_naming_the_problem(client, path, payload, status, names):
    kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = client.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    assert names in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "still up", "max_tokens": 1}).status_code == 200


def test_client_disconnect_mid_stream_stops_generation_and_the_server_keeps_serving(live, engine):
    before = engine.abandoned
    with httpx.Client(base_url=live, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True,
                                                          "draft": False}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))  # generation has started
        deadline = time.time() + 30
        while engine.abandoned == before and time.time() < deadline:
            time.sleep(0.1)
        assert engine.abandoned == before + 1  # stopped long before 2000 tokens
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------ concurrency, load

def _request_kinds():
    kinds = []
    for i in range(10):
        body = {"prompt": [100 + 7 * i, 200 + i, 300], "max_tokens": 3, "seed": i}
        if i % 2:
            body["temperature"] = 0.8
        if i % 3 == 0:
            body["draft"] = False
        kinds.append(body)
    return kinds


def test_load_200_requests_8_concurrent_every_reply_equals_its_solo_run(live, engine):
    kinds = _request_kinds()
    expected = [solo(engine, k["prompt"], max_tokens=3, seed=k["seed"], temperature=k.get("temperature", 0.0),
                     draft=k.get("draft")) for k in kinds]
    peaks = {}

    def one(n):
        body = kinds[n % len(kinds)]
        with httpx.Client(base_url=live, timeout=120) as http:
            r = http.post("/v1/completions", json=body)
            if n + 1 in (20, 200):
                peaks[n + 1] = http.get("/health").json()["peak_rss_gb"]
        return n, r.status_code, r.json()

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(200)))
    errors = [(n, s, b) for n, s, b in results if s != 200]
    assert not errors, errors[:3]
    wrong = [n for n, _, b in results if b["choices"][0]["text"] != expected[n % len(kinds)]]
    assert not wrong, f"{len(wrong)} replies differ from their solo runs (first: request {wrong[0]})"
    print(f"\npeak RSS at request 20: {peaks[20]:.3f} GB, at request 200: {peaks[200]:.3f} GB")
    assert peaks[200] <= peaks[20] * 1.05 + 0.05


# ---------------------------------------------------------- startup failures

FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "reference-v41-tiny"


def _damaged(tmp_path, how: str):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    shard = ckpt / "model-00002-of-00002.safetensors"
    if how == "missing shard":
        shard.unlink()
    elif how == "corrupt shard":
        shard.write_bytes(shard.read_bytes()[:-4096])
    else:  # a config of another model_type
        config = json.loads((ckpt / "config.json").read_text())
        config["model_type"] = "llama"
        (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize("how, names", [("missing shard", "missing"), ("corrupt shard", "truncated"),
                                        ("another model_type", "llama")])
def test_server_refuses_a_bad_checkpoint_with_a_clear_message(tmp_path, how, names):
    import subprocess
    import sys

    ckpt = _damaged(tmp_path, how)
    out = subprocess.run([sys.executable, "-m", "dsv41_mlx.server", "--model", str(ckpt), "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and names in out.stderr and "error:" in out.stderr


def test_warm_up_flag_runs_the_warm_up_before_serving(monkeypatch, caplog):
    """`--warm-up` runs generate.warm_up on the loaded model before the server starts, and logs
    its seconds; without it nothing is run."""
    import logging

    import dsv41_mlx.server as server

    events = []
    monkeypatch.setattr(server, "warm_up", lambda model: events.append("warm-up") or 1.5)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: events.append("serve"))
    with caplog.at_level(logging.INFO):
        assert server.main(["--warm-up"]) == 0
    assert events == ["warm-up", "serve"] and "warm-up: every request shape once, 1.5 s" in caplog.text
    events.clear()
    assert server.main(["--quiet"]) == 0
    assert events == ["serve"]
