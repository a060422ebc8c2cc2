"""The command line, `python -m dsv41_mlx.generate`: every argument checked before a model
loads, the empty-prompt message shared with the server, --help, --quiet and --no-stats."""

import importlib
import os
import re
import subprocess
import sys

import pytest

from dsv41_mlx.io import checkpoint
from dsv41_mlx.io import load as loader
from dsv41_mlx.server import RequestError, parse_request

from .processes import run_all

cli = importlib.import_module("dsv41_mlx.generate")  # the module (the package exports a function so named)
PROG = "python -m dsv41_mlx.generate"
CMD = [sys.executable, "-m", "dsv41_mlx.generate"]


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """main() where loading a model (or downloading one, or building the embedded default)
    fails the test."""
    def refuse(*args, **kwargs):
        pytest.fail(f"a model was loaded: {args} {kwargs}")

    import huggingface_hub

    monkeypatch.setattr(loader, "load", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DSV41_MLX_CACHE", str(cache))
    yield
    assert not any(cache.iterdir()), "the embedded default was built"


def run_main(argv, capsys) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str) -> str:
    """The message of argparse's one error line (after the usage lines)."""
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: error: "), err
    return last[len(f"{PROG}: error: "):]


# ------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("argv, flag", [
    (["--temp", "-3"], "--temp"),
    (["--temp", "nan"], "--temp"),
    (["--temp", "warm"], "--temp"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "-5"], "--max-tokens"),
    (["--max-tokens", "1.5"], "--max-tokens"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-p", "-0.1"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**31)], "--seed"),
    (["--verify", "sometimes"], "--verify"),
    (["--verify", "rejection"], "--verify"),  # at --temp 0
    (["--temp", "0.5", "--verify", "greedy"], "--verify"),
    (["--no-draft", "--verify", "greedy"], "--verify"),
    (["--confidence", "sometimes"], "--confidence"),
    (["--confidence", "threshold:2"], "--confidence"),
    (["--confidence", "threshold:x"], "--confidence"),
    (["--no-draft", "--confidence", "off"], "--confidence"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--prefill-chunk", "-16"], "--prefill-chunk"),
    (["--model", "no-such-dir"], "--model"),
    (["--model", "./no/such-dir"], "--model"),
    (["--model", "a/b/c"], "--model"),
])
def test_a_bad_argument_exits_2_naming_it_before_any_model_loads(no_loading, capsys, argv, flag):
    code, out, err = run_main(["--max-tokens", "2"] + argv, capsys)
    assert code == 2 and out == ""
    message = error_line(err)
    assert message.startswith(f"argument {flag}: "), message
    assert "Traceback" not in err


def test_a_model_path_that_is_a_file_or_missing_is_named(no_loading, capsys, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    for path, why in ((tmp_path / "weights.safetensors", "expected a checkpoint directory"),
                      (tmp_path / "nope", "no such directory")):
        code, _, err = run_main(["--model", str(path)], capsys)
        assert code == 2
        message = error_line(err)
        assert message.startswith("argument --model: ") and str(path) in message and why in message


def test_a_hub_id_passes_the_checks_and_goes_to_the_loader(monkeypatch, capsys):
    """owner/name is not refused for being absent locally: it is what the loader downloads."""
    asked = []

    def load(path, progress=False):
        asked.append(path)
        raise checkpoint.CheckpointError("stop here")

    monkeypatch.setattr(loader, "load", load)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kwargs: None)  # the root logger left alone
    code, _, err = run_main(["--model", "deepseek-ai/DeepSeek-V4.1-Flash"], capsys)
    assert asked == ["deepseek-ai/DeepSeek-V4.1-Flash"] and code == 2 and "stop here" in err


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_an_empty_prompt_is_refused_with_the_servers_message(no_loading, capsys, prompt):
    class NoBosTokenizer:  # the real tokenizer adds BOS, so the server sees an empty prompt only without one
        vocab_size = 10

        def encode(self, text):
            return []

    with pytest.raises(RequestError) as server:
        parse_request({"prompt": ""}, "completion", "m", NoBosTokenizer(), 4096)
    assert server.value.status == 400 and server.value.param == "prompt"
    code, _, err = run_main(["--prompt", prompt], capsys)
    assert code == 2 and error_line(err) == server.value.message


def test_a_bad_argument_through_the_real_entry_point_has_no_traceback(tmp_path):
    out = subprocess.run(CMD + ["--temp", "-3"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DSV41_MLX_CACHE": str(tmp_path)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert error_line(out.stderr).startswith("argument --temp: ")
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ --help

def test_help_describes_the_command_and_shows_the_defaults(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    text = " ".join(out.split())  # whatever the terminal width
    assert text.startswith(f"usage: {PROG} ")
    assert "Generate a reply to a prompt" in text and f"{PROG} --prompt \"Hello\"" in text
    assert "`generate_step`" not in text  # not the module's docstring
    options = text[text.index("options:"):]
    for flag, default in [("--prompt", "Hello"), ("--max-tokens", "64"), ("--temp", "0.0"), ("--top-p", "1.0"),
                          ("--top-k", "0"), ("--seed", "0"), ("--prefill-chunk", "256"), ("--wire", "True"),
                          ("--model", "the embedded tiny model"), ("--draft", "on when the checkpoint has one"),
                          ("--verify", "greedy at --temp 0, else coupled"), ("--confidence", "schedule")]:
        after = options[re.search(re.escape(flag) + "[ ,]", options).start():]
        said = after[after.index("(default: "):]
        assert said.startswith(f"(default: {default})"), (flag, said[:60])
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--no-stats" in options


# ---------------------------------------------------------- --quiet, --no-stats

@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """An environment whose embedded default is built (by a first run), for the runs below."""
    env = {**os.environ, "DSV41_MLX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    first = subprocess.run(CMD + ["--max-tokens", "1", "--quiet", "--no-stats"], capture_output=True, text=True,
                           env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    return env


def stats_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("prompt:", "drafts:"))]


def test_quiet_keeps_the_stats_line_and_no_stats_drops_it(cli_env):
    base = CMD + ["--prompt", "Hello", "--max-tokens", "2"]
    every = [(), ("--quiet",), ("--no-stats",), ("--quiet", "--no-stats")]
    runs = dict(zip(every, run_all([base + list(flags) for flags in every], env=cli_env, timeout=300)))
    for flags, run in runs.items():
        assert run.returncode == 0, (flags, run.stderr)
        assert run.stdout.strip() and run.stdout == runs[()].stdout, flags  # the reply, whatever the flags

    loud = runs[()].stderr
    assert "loading weights" in loud and "drafter FP8 head" in loud  # what --quiet has to hide
    assert [line[:7] for line in stats_lines(loud)] == ["prompt:", "drafts:"]

    quiet = runs[("--quiet",)].stderr
    assert [line[:7] for line in quiet.splitlines()] == ["prompt:", "drafts:"]  # nothing but the stats
    assert "generation: 2 tokens" in quiet.splitlines()[0] and "peak memory" in quiet.splitlines()[0]

    no_stats = runs[("--no-stats",)].stderr
    assert "loading weights" in no_stats and stats_lines(no_stats) == []
    assert runs[("--quiet", "--no-stats")].stderr == ""
