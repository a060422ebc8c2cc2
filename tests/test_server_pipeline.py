"""The server under `mlx.launch --backend ring` (loopback): rank 0 serves HTTP through a
PipelineRunner while the other rank follows it; its replies are one process's (a second turn
resumed from the prompt cache, which each rank keeps its part of), and a Ctrl-C stops every
rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

import dsv41_mlx
from dsv41_mlx.server import Engine, create_app
from scripts.benchmarks.harness import mlx_launch

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Tell me about lighthouses."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replies(client: openai.OpenAI) -> tuple[list[str], int]:
    """A chat reply, the same request streamed, and a second turn after the reply, through the
    official client; and how many of the second turn's prompt tokens came from a prompt cache."""
    whole = client.chat.completions.create(model="dsv41-tiny", messages=CHAT, max_tokens=12)
    stream = client.chat.completions.create(model="dsv41-tiny", messages=CHAT, max_tokens=12, stream=True)
    first = whole.choices[0].message.content
    turn = CHAT + [{"role": "assistant", "content": first}, {"role": "user", "content": "And their keepers?"}]
    second = client.chat.completions.create(model="dsv41-tiny", messages=turn, max_tokens=8)
    details = second.usage.prompt_tokens_details
    texts = [first, "".join(c.choices[0].delta.content or "" for c in stream if c.choices),
             second.choices[0].message.content]
    return texts, details.cached_tokens if details is not None and details.cached_tokens else 0


@pytest.fixture(scope="module")
def one_process() -> list[str]:
    model, tokenizer = dsv41_mlx.load()
    with TestClient(create_app(Engine(model, tokenizer, "dsv41-tiny"))) as http:
        return replies(openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http))


def wait_until_serving(url: str, launcher: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    pytest.fail("the server under mlx.launch did not start")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_ranks_serve_one_process_replies_and_a_ctrl_c_stops_every_rank(one_process, tmp_path):
    port = free_port()
    err = (tmp_path / "stderr").open("w+")
    launcher = subprocess.Popen(
        mlx_launch(2, [sys.executable, "-m", "dsv41_mlx.server", "--port", str(port), "--quiet"]),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, launcher)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="-") as client:
            texts, cached = replies(client)
            assert texts == one_process[0]
            assert cached > 0  # the second turn resumed from the first's state, cached across the ranks
        os.killpg(launcher.pid, signal.SIGINT)  # a Ctrl-C in the launcher's terminal: every process gets it
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 10
        while group_alive(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(launcher.pid)
    finally:
        if group_alive(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)
    err.seek(0)
    # rank 0 shut down and closed its runner; rank 1 ignored the Ctrl-C and left at rank 0's STOP:
    # both exited 0 (mlx.launch names a rank that exits otherwise, or that it kills)
    assert "Node with rank" not in err.read()
