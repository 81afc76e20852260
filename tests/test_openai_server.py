"""`cpuforge serve` as a user meets it: started from the command line, talked to with the `openai` client
(whole answers and streams, completions and chat), refused without its key, restarted, and refusing to listen
beyond loopback without one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cpuforge.models.checkpoint import save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama
from cpuforge.models.runtime import load_language_model
from cpuforge.tasks.release.openai_server import StopScan

openai = pytest.importorskip("openai")

KEY = "test-key-0123456789"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A small random model with a byte-level tokenizer (multi-byte characters split across tokens) and a chat
    template in its tokenizer_config.json, as transformers saves one."""
    folder = tmp_path_factory.mktemp("serve") / "chat-lm"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["def add(a, b):\n    return a + b  # süß, 日本語\n" * 20, "<|user|>hi\n<|assistant|>hello\n" * 20]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    save_model(Llama(LlamaConfig(vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=1, d_model=32,
                                 d_mlp=64, block_size=64)), folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                              "eos_token": "<|endoftext|>"}))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path | None, port: int, *extra: str) -> subprocess.Popen:
    """`cpuforge serve [MODEL] --port PORT ...` with an API key, once it answers /health."""
    server = subprocess.Popen([sys.executable, "-m", "cpuforge.flows.cli", "serve", *([str(model)] if model else []),
                               "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "CPUFORGE_API_KEY": KEY})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited: {server.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    pytest.fail("the server did not answer /health within 120 s")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def served(chat_model):
    port = free_port()
    server = start(chat_model, port)
    yield port
    stop(server)


def client(port: int, key: str = KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def test_completions_whole_and_streamed_are_cpuforges_own_greedy_text(served, chat_model):
    lm = load_language_model(chat_model)
    expected = lm.complete("def add(", 12, temperature=0)
    api = client(served)
    assert [m.id for m in api.models.list().data] == ["chat-lm"]
    whole = api.completions.create(model="chat-lm", prompt="def add(", max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason in ("length", "stop")
    prompt_tokens = len(lm.encode("def add("))
    assert whole.usage.prompt_tokens == prompt_tokens and 0 < whole.usage.completion_tokens <= 12
    chunks = list(api.completions.create(model="chat-lm", prompt="def add(", max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    # top_p 0 keeps only the likeliest token: greedy whatever the temperature
    assert api.completions.create(model="chat-lm", prompt="def add(", max_tokens=12, temperature=1.5,
                                  top_p=0).choices[0].text == expected


def test_a_seed_repeats_a_sample_and_a_stop_string_ends_the_text_before_it(served):
    api = client(served)
    first, again = (api.completions.create(model="chat-lm", prompt="def ", max_tokens=20, temperature=1.0, seed=7).choices[0].text
                    for _ in range(2))
    assert first == again
    cut = next((c for c in first[1:] if c.strip()), None)
    if cut is None:
        pytest.skip("the sample has no visible character to stop at")
    stopped = api.completions.create(model="chat-lm", prompt="def ", max_tokens=20, temperature=1.0, seed=7,
                                     stop=[cut])
    assert stopped.choices[0].text == first[:first.index(cut)] and stopped.choices[0].finish_reason == "stop"


def test_chat_renders_the_models_template_and_streams_the_same_answer(served, chat_model):
    lm = load_language_model(chat_model)
    messages = [{"role": "user", "content": "hi"}]
    expected = lm.complete("<|user|>hi\n<|assistant|>", 10, temperature=0)
    api = client(served)
    whole = api.chat.completions.create(model="chat-lm", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    stream = list(api.chat.completions.create(model="chat-lm", messages=messages, max_tokens=10, temperature=0,
                                              stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_requests_the_server_refuses_say_why_in_openais_error_shape(served):
    with pytest.raises(openai.AuthenticationError):
        client(served, "wrong-key").models.list()
    api = client(served)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        api.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context is 64 tokens"):
        api.completions.create(model="chat-lm", prompt="def add(a, b): " * 40, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature must be a number from 0 to 2"):
        api.completions.create(model="chat-lm", prompt="x", max_tokens=1, temperature=5)
    with urllib.request.urlopen(f"http://127.0.0.1:{served}/health") as r:  # probes need no key
        assert json.load(r) == {"status": "ok"}
    request = urllib.request.Request(f"http://127.0.0.1:{served}/v1/embeddings", b"{}",
                                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request)
    assert missing.value.code == 404 and json.load(missing.value)["error"]["type"] == "not_found_error"


def test_a_model_without_a_chat_template_answers_completions_and_refuses_chat(chat_model, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (plain / name).write_bytes((chat_model / name).read_bytes())
    port = free_port()
    server = start(plain, port)
    try:
        api = client(port)
        assert api.completions.create(model="plain", prompt="def ", max_tokens=3, temperature=0).choices[0].text is not None
        with pytest.raises(openai.NotFoundError, match="has no chat template"):
            api.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    finally:
        stop(server)
    server = start(plain, port)  # restarted on the same port: answers as before
    try:
        assert client(port).completions.create(model="plain", prompt="def ", max_tokens=3,
                                                    temperature=0).choices[0].text is not None
    finally:
        stop(server)


def test_serving_beyond_loopback_without_a_key_is_refused_in_one_line(chat_model):
    env = {k: v for k, v in os.environ.items() if k != "CPUFORGE_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "cpuforge.flows.cli", "serve", str(chat_model), "--host", "0.0.0.0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: refusing to serve on 0.0.0.0 without an API key: pass --api-key or set "
                                   "CPUFORGE_API_KEY (clients send it as Authorization: Bearer KEY), or serve on "
                                   "127.0.0.1")


def test_a_stream_never_shows_the_start_of_a_stop_string():
    scan = StopScan(["END"])
    shown = [scan.feed(p) for p in ("abc E", "N", "D tail")]
    assert "".join(shown) == "abc " and scan.stopped
    scan = StopScan(["END"])
    assert scan.feed("abc EN") == "abc " and scan.feed("x") + scan.flush() == "ENx" and not scan.stopped
