"""One model behind the OpenAI API, for the clients people already have (the `openai` package, LangChain,
curl): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (when the model's tokenizer has a chat
template) and ``/health``, answers whole or streamed as server-sent events. FastAPI and uvicorn serve it (the
stack Prefect's own server runs on); the chat template is rendered by transformers, as its tokenizers do.

Generation is one request at a time: on a CPU a second decode in parallel only halves both. Requests queue on a
lock, a streamed one holding it until its last token or until its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from fastapi import APIRouter, Depends, FastAPI, Header, Request  # module level: FastAPI reads annotations here
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers.decoders import DecodeStream

from cpuforge.models.runtime import LanguageModel, check_prompt, generate

DONE = "data: [DONE]\n\n"
log = logging.getLogger("cpuforge.serve")


class RequestError(ValueError):
    """A request the API refuses: its message goes back as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]


@dataclass
class Finish:
    reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class StopScan:
    """Text pieces with the stop strings cut: holds back what could be the start of one until the next piece
    settles it, so a stream never shows part of a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.pending, self.stopped = [s for s in stop if s], "", False
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def feed(self, piece: str) -> str:
        self.pending += piece
        cuts = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            out, self.pending = self.pending[:min(cuts)], ""
            return out
        cut = len(self.pending) - self.hold
        out, self.pending = self.pending[:max(cut, 0)], self.pending[max(cut, 0):]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Engine:
    """The model and what the API needs of it: token counts, a finish reason, stop strings, one at a time."""

    def __init__(self, lm: LanguageModel, model_id: str) -> None:
        self.lm, self.model_id, self.lock = lm, model_id, threading.Lock()
        self.created = int(time.time())
        self._chat_tokenizer: Any = None

    def prompt_ids(self, prompt: str) -> list[int]:
        ids = self.lm.encode(prompt)
        try:
            check_prompt(len(ids), self.lm.cfg.block_size)
        except ValueError as exc:
            raise RequestError(str(exc), param="prompt") from None
        return ids

    def run(self, ids: list[int], sampling: Sampling, finish: list[Finish],
            gone: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Text pieces of the continuation of ``ids``; appends the Finish to ``finish`` when done. Stops early,
        finishing nothing, once ``gone()`` says the client left (checked before the model is taken, and per token)."""
        lm, left = self.lm, self.lm.cfg.block_size - len(ids)
        budget = left if sampling.max_tokens is None else min(sampling.max_tokens, left)
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        temperature = 0.0 if sampling.top_p == 0 else sampling.temperature  # top_p 0 keeps only the likeliest
        text, stops, count, reason = DecodeStream(ids=ids, skip_special_tokens=True), StopScan(sampling.stop), 0, "stop"
        with self.lock:
            if gone():
                return
            tokens = generate(lm.decoder, ids, budget, temperature, None, lm.eod_id, generator,
                              sampling.top_p if 0 < sampling.top_p < 1 else None)
            for token in tokens:
                if gone():
                    return
                count += 1
                piece = text.step(lm.tokenizer, token)
                if piece is not None and (shown := stops.feed(piece)):
                    yield shown
                if stops.stopped:
                    break
            else:
                reason = "length" if count == budget else "stop"  # else the end-of-document token came
        if not stops.stopped and (rest := stops.flush()):
            yield rest
        finish.append(Finish(reason, len(ids), count))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if not self.lm.chat_template:
            raise RequestError(f"{self.model_id} has no chat template (its tokenizer_config.json or "
                               "chat_template.jinja names none): use /v1/completions with a text prompt",
                               status=404, kind="not_found_error")
        if self._chat_tokenizer is None:
            from transformers import PreTrainedTokenizerFast

            eod = self.lm.tokenizer.id_to_token(self.lm.eod_id) if self.lm.eod_id is not None else None
            self._chat_tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.lm.tokenizer, eos_token=eod,
                                                           chat_template=self.lm.chat_template)
        try:
            return self._chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own raise_exception, or a message it cannot render
            raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages") from None


def sampling_of(body: dict[str, Any], default_max: int | None) -> Sampling:
    def number(name: str, default: float, low: float, high: float) -> float:
        value = body.get(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
            raise RequestError(f"{name} must be a number from {low:g} to {high:g}, not {value!r}", param=name)
        return float(value)

    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1: this server makes one choice per prompt", param="n")
    if body.get("logprobs") not in (None, False) or body.get("echo"):
        raise RequestError("logprobs and echo are not supported", param="logprobs")
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                      default_max)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, not {max_tokens!r}", param="max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a string or a list of up to 4 strings", param="stop")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError("stream_options must be an object such as {\"include_usage\": true}", param="stream_options")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(f"seed must be an integer, not {seed!r}", param="seed")
    return Sampling(max_tokens, number("temperature", 1.0, 0, 2), number("top_p", 1.0, 0, 1), seed, stop)


def completion_prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be one string of text", param="prompt")
    return prompt


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: this model reads text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise RequestError(f"messages[{i}] must have a role and text content", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The FastAPI application; with ``api_key`` every /v1 route wants ``Authorization: Bearer KEY`` (/health
    stays open for probes)."""
    app = FastAPI(title=f"cpuforge: {engine.model_id}", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    def refused(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # an unknown route, a wrong method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(RequestError(str(exc.detail), exc.status_code, kind=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    def failed(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(server_error(exc).body(), status_code=500)

    def authorized(authorization: str | None = Header(None)) -> None:
        expected = f"Bearer {api_key}".encode()
        if api_key and not hmac.compare_digest((authorization or "").encode(), expected):
            raise RequestError("a valid API key is needed: send Authorization: Bearer KEY", 401,
                               kind="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the request body must be a JSON object") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("model") not in (None, "", engine.model_id):
            raise RequestError(f"model {body['model']!r} is not served here; this server serves "
                               f"{engine.model_id!r}", 404, "model", "not_found_error")
        return body

    @app.get("/health")
    async def health() -> dict[str, str]:  # on the event loop: answers while every worker thread waits its turn
        return {"status": "ok"}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": engine.created,
                                            "owned_by": "cpuforge"}]}

    async def respond(request: Request, body: dict[str, Any], prompt: str, chat: bool, default_max: int | None):
        sampling, ids = sampling_of(body, default_max), engine.prompt_ids(prompt)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": engine.model_id}
        finish: list[Finish] = []
        if not body.get("stream"):
            pieces: list[str] = []
            async with contextlib.aclosing(in_one_thread(partial(engine.run, ids, sampling, finish))) as made:
                async for piece in made:
                    pieces.append(piece)
                    if len(pieces) % 16 == 0 and await request.is_disconnected():
                        return Response(status_code=499)  # nobody to answer: stop decoding for them
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text, "logprobs": None})
            return {**head, "object": "chat.completion" if chat else "text_completion",
                    "choices": [{**choice, "finish_reason": finish[0].reason}], "usage": finish[0].usage()}
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason: str | None = None, first: bool = False) -> str:
            if chat:  # the first delta names the role, the last one is empty and gives the finish reason
                delta = ({"role": "assistant"} if first else {}) | ({} if piece is None else {"content": piece})
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
            extra = {"usage": None} if with_usage else {}
            return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **extra})}\n\n"

        def events(gone: Callable[[], bool]) -> Iterator[str]:
            if chat:
                yield chunk("", first=True)
            for piece in engine.run(ids, sampling, finish, gone):
                yield chunk(piece)
            if finish:
                yield chunk(None, finish[0].reason)
                if with_usage:
                    usage = {**head, "object": kind, "choices": [], "usage": finish[0].usage()}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield DONE

        async def stream() -> AsyncIterator[str]:
            try:
                async for event in in_one_thread(events):
                    yield event
            except Exception as exc:  # noqa: BLE001  the headers are out: the error goes in the stream, as an event
                yield f"data: {json.dumps(server_error(exc).body())}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @v1.post("/completions")
    async def completions(request: Request):
        body = await json_body(request)
        return await respond(request, body, completion_prompt(body), False, 16)  # 16: the API's default length

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        prompt = await run_in_threadpool(engine.render_chat, chat_messages(body))  # transformers, the first time
        return await respond(request, body, prompt, True, None)

    app.include_router(v1)
    return app


def server_error(exc: Exception) -> RequestError:
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return RequestError(f"the server failed: {type(exc).__name__}: {exc}", 500, kind="server_error")


_END = object()


async def in_one_thread(make: Callable[[Callable[[], bool]], Iterator[str]]) -> AsyncIterator[str]:
    """The items of the generator ``make(gone)``, made in one worker thread and handed to the event loop as they
    come. Starlette's own way with a plain generator sends every next() to the thread pool: a hop per token that
    cost a 135M int8 model 12% of its decode speed through the server. When the consumer stops (the client went
    away), ``gone()`` turns true and the generator stops at its next token, freeing the model's lock."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def hand_over(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is stopping
            gone.set()

    def produce() -> None:
        items = make(gone.is_set)
        try:
            for item in items:
                if gone.is_set():
                    break
                hand_over(item)
        except Exception as exc:  # noqa: BLE001  (raised again on the loop's side)
            hand_over(exc)
        finally:
            items.close()  # type: ignore[attr-defined]
            hand_over(_END)

    loop.run_in_executor(None, produce)
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]
    finally:
        gone.set()


def serve(engine: Engine, host: str, port: int, api_key: str | None) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="warning", access_log=False)
