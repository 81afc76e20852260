"""Decode speed through `cpuforge serve` (the OpenAI API, streamed) against the same model decoding in-process.

    python benchmarks/serve_decode.py MODEL [--tokens 128] [--rounds 3] [--port 8123]

MODEL is anything `cpuforge serve` takes (a model folder, an .onnx file or GenAI folder, a stage output).
In-process: greedy decoding with the KV cache after a short prompt (models/runtime.generate), tokens/s from the
first new token to the last. Served: the same prompt and settings through the `openai` client's stream, tokens/s
from the first streamed chunk to the last, counted by the server's usage. The server runs in its own process,
idle while the in-process rounds run; rounds alternate between the two and each figure is the best round.
Goal: the served figure within 15% of the in-process one.

Client: the same `openai` client reading a canned stream of as many chunks (the server's own chunk shape), sent
all at once by a plain HTTP server in another process, best of the rounds: how many tokens/s the client alone
can take on this machine. 1 / client is the client's time per token, which a served stream spends on the same
cores as the model (the last line says what share of an in-process token's time that is).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from cpuforge.models.runtime import generate
from cpuforge.tasks.release.register import open_model

PROMPT = "def main():\n    "
KEY = "benchmark-key"


def in_process(lm, tokens: int) -> float:
    ids = lm.encode(PROMPT)
    stamps = [time.perf_counter() for _ in generate(lm.decoder, ids, tokens, 0.0, None, None)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def served(client, name: str, tokens: int) -> float:
    stamps, count = [], 0
    for chunk in client.completions.create(model=name, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            count = chunk.usage.completion_tokens
    return (count - 1) / (stamps[-1] - stamps[0])


def canned_stream(tokens: int) -> bytes:
    """A completion stream of ``tokens`` one-word chunks in the shape the server writes, then usage and [DONE]."""
    head = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "bench"}
    chunk = {**head, "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
             "usage": None}
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                                              "total_tokens": tokens + 5}}
    events = [f"data: {json.dumps(chunk)}\n\n"] * tokens + [f"data: {json.dumps(usage)}\n\n", "data: [DONE]\n\n"]
    return "".join(events).encode()


def serve_canned(port: int, body: bytes) -> None:
    """Answer every POST with ``body`` as an event stream, in one write (the client's reading is what is timed)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Canned(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Canned).serve_forever()


def client_tok_s(tokens: int, rounds: int) -> list[float]:
    """The openai client's tokens/s on a canned stream (see the module's docstring), one figure per round."""
    import multiprocessing

    import openai

    port = _free_port()
    canned = multiprocessing.get_context("spawn").Process(target=serve_canned, args=(port, canned_stream(tokens)),
                                                          daemon=True)
    canned.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=2)
        for _ in range(100):
            try:
                served(client, "bench", tokens)  # warm-up, and the server is up once it answers
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        return [served(client, "bench", tokens) for _ in range(rounds)]
    finally:
        canned.terminate()


def start_server(model: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "cpuforge.flows.cli", "serve", model, "--port", str(port),
                               "--served-model-name", "bench"], env={**os.environ, "CPUFORGE_API_KEY": KEY})
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return server
        except OSError:
            if server.poll() is not None:
                sys.exit("the server exited")
            time.sleep(0.5)
    server.kill()
    sys.exit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    import openai

    port = args.port or _free_port()
    lm = open_model(args.model)
    # no end-of-document stop: every round decodes the same number of tokens
    tokens = min(args.tokens, lm.cfg.block_size - len(lm.encode(PROMPT)))
    server = start_server(args.model, port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    try:
        in_process(lm, 8), served(client, "bench", 8)  # warm-up: first-call costs out of the figures
        here, there = [], []
        for _ in range(args.rounds):
            here.append(in_process(lm, tokens))
            there.append(served(client, "bench", tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = {"model": args.model, "kind": lm.kind, "params": lm.params, "tokens": tokens, "rounds": args.rounds,
              "in_process_decode_tok_s": round(max(here), 1), "served_decode_tok_s": round(max(there), 1),
              "served_vs_in_process": round(max(there) / max(here), 3),
              "samples": {"in_process": [round(x, 1) for x in here], "served": [round(x, 1) for x in there]}}
    print(json.dumps(result, indent=2), flush=True)  # before the client's rounds: a failure there loses nothing
    alone = client_tok_s(tokens, args.rounds)
    print(json.dumps({"client_alone_tok_s": round(max(alone), 1), "samples": [round(x, 1) for x in alone]}, indent=2))
    print(f"the openai client alone reads {max(alone):,.0f} tokens/s: {1e6 / max(alone):,.0f} us of client per "
          f"token, {max(here) / max(alone):.0%} of an in-process token's {1e6 / max(here):,.0f} us")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
