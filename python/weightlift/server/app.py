"""The routes: completions and chat completions (plain or SSE), embeddings, the tokenizer's
extras, the model list and health."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

import weightlift
from weightlift._llama import embedding_ids, embedding_response
from weightlift.server.errors import SERVER, APIError, from_engine, install
from weightlift.server.scheduler import Job, Scheduler
from weightlift.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    _Sampling,
)
from weightlift.server.slots import QueueFull, Slots

# Seconds between looks at whether the client of a non-streamed request is still there.
DISCONNECT_POLL = 0.25


def timings(t: dict[str, float] | None) -> dict[str, float] | None:
    """A generation's times (``Model.timings``' keys) under llama.cpp's server's names."""
    if t is None:
        return None
    prompt_n, prompt_ms = t["prompt_tokens"], t["prompt_ms"]
    eval_n, eval_ms = t["eval_tokens"], t["eval_ms"]
    return {
        "cache_n": int(t["reused_tokens"]),
        "prompt_n": int(prompt_n),
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": int(eval_n),
        "predicted_ms": eval_ms,
        "predicted_per_token_ms": eval_ms / eval_n if eval_n else 0.0,
        "predicted_per_second": 1e3 * eval_n / eval_ms if eval_ms > 0 else 0.0,
    }


def _base64(vector: list[float] | list[list[float]]) -> str:
    """``vector`` as little-endian float32 bytes in base64, what the ``openai`` client decodes
    by default; one vector per token (a model without pooling) goes row after row."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _memory(model: weightlift.Model) -> list[dict[str, Any]]:
    """Per device of the plan: the bytes it counts (weights, KV cache, scratch), those held now
    and the most allocated at once since the load (mmap views are held, not allocated)."""
    plan = model.plan
    held, peak = model.memory(), model.peak_memory()
    return [
        {
            "name": d.name,
            "planned": d.weights + d.kv + d.scratch,
            "held": held.get(d.name, 0),
            "peak": peak.get(d.name, 0),
        }
        for d in (plan.devices if plan is not None else [])
    ]


class _SlotStream(StreamingResponse):
    """An SSE response that ends its generation and gives its slot back once sent, cut off,
    or never started."""

    def __init__(self, body: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels what outlasts its graceful shutdown: the stream is cut there, which
            # is the shutdown's doing, not an error of the application for uvicorn to log
            return
        finally:
            # Sync on purpose: this also runs in a cancelled task.
            self._release()


class Server:
    """One model behind the slots; the routes' shared state."""

    def __init__(
        self, model: weightlift.Model, alias: str, parallel: int, queue: int, embedding: bool
    ) -> None:
        self.alias = alias
        self.embedding = embedding
        self.slots = Slots(parallel, queue)
        self.scheduler = Scheduler(model, parallel)
        self.created = int(time.time())

    def close(self) -> None:
        """Stop the engine thread."""
        self.scheduler.close()

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.alias:
            raise APIError(
                404,
                f"model: '{name}' is not served here; this server serves '{self.alias}'",
                param="model",
                code="model_not_found",
            )

    def model_entry(self, name: str) -> dict[str, Any]:
        """The entry of ``/v1/models`` for ``name``: 404 ``model_not_found`` unless served."""
        self._check_model(name)
        return {"id": self.alias, "object": "model", "created": self.created, "owned_by": "me"}

    async def call(
        self, fn: Callable[[weightlift.Model], Any], fields: Collection[str], field: str
    ) -> Any:
        """``fn(model)`` on the engine thread (see ``Scheduler.call``). A refusal is a 4xx
        naming ``field``, the one field of the request that reaches the model; a too-long input
        is the 400 of a too-long prompt."""
        try:
            return await self.scheduler.call(fn)
        except Exception as e:
            err = from_engine(e, fields, {"prompt": field})
            if err.param is None and err.status < 500:
                err.param = field
            raise err from e

    async def embed(self, body: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embedding response: each input a call of its own on the engine thread, so
        running generations wait for one input's forward pass at a time, not a whole list's."""
        if not self.embedding:
            # llama.cpp's answer, and its switch's name in llama-cpp-python's server
            raise APIError(
                501,
                "this server does not serve embeddings; start it with --embedding (which plans "
                "one more cache of --ctx positions for them)",
                type="not_supported_error",
                code="embeddings_off",
            )
        self._check_model(body.model)
        try:
            inputs = body.inputs()
        except ValueError as e:
            raise APIError(400, str(e), param="input", code="invalid_value") from None
        fields = set(type(body).model_fields)

        def one(given: str | list[int]) -> Callable[[weightlift.Model], tuple[Any, int]]:
            def run(model: weightlift.Model) -> tuple[Any, int]:
                ids = embedding_ids(model, given) if isinstance(given, str) else given
                # the pooling the model asks for (llama-cpp-python's server leaves it to the
                # model too), not normalised: llama-cpp-python's create_embedding
                return model.embed(ids), len(ids)

            return run

        calls = [self.call(one(given), fields, "input") for given in inputs]
        vectors: list[Any] = []
        total = 0
        for i, outcome in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, APIError) and len(inputs) > 1:
                    outcome.message = f"input[{i}]: {outcome.message}"
                raise outcome
            vector, n = outcome
            vectors.append(vector)
            total += n
        first = vectors[0]
        width = len(first[0]) if isinstance(first[0], list) else len(first)  # per token: rows
        if body.dimensions is not None and body.dimensions != width:
            raise APIError(
                400,
                f"dimensions: this model's embeddings have {width} dimensions and are not "
                f"shortened, got {body.dimensions}; leave dimensions out",
                param="dimensions",
                code="invalid_value",
            )
        response = embedding_response(vectors, total, self.alias)
        if body.encoding_format == "base64":
            for entry in response["data"]:
                entry["embedding"] = _base64(entry["embedding"])
        return response

    async def generate(
        self, request: Request, body: _Sampling, method: str, roles: dict[str, str]
    ) -> Response:
        """Run ``model.<method>(**body.kwargs())`` in a slot of the batch: ``n`` times for ``n``
        choices, for each prompt of a batch of prompts (choice ``p · n + i`` is prompt ``p``'s
        ``i``-th), each generation in a slot of its own, those beyond the free slots waiting in
        line; JSON, or SSE when streaming. A completion's ``best_of`` above 1 runs that many
        candidates a prompt and answers with the ``n`` best (see ``_best``)."""
        self._check_model(body.model)
        try:
            kwargs = body.kwargs()  # type: ignore[attr-defined]
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None
        fields = set(type(body).model_fields)
        if body.logit_bias_type == "tokens" and body.logit_bias:
            kwargs["logit_bias"] = await self.call(
                lambda m: _bias_by_text(m, body.logit_bias or {}), fields, "logit_bias"
            )
        prompts = body.prompts() if isinstance(body, CompletionRequest) else [None]
        n = body.n
        # candidates a prompt: best_of's (a completion's) where it asks for more than n
        runs = _candidates(body)
        if runs > n and kwargs.get("logprobs") is None:
            kwargs["logprobs"] = 0  # to rank them by; _best takes them out again
        total = len(prompts) * runs
        most = self.slots.parallel + self.slots.queue
        if total > most:
            each = "n" if runs == n else "best_of"
            what = each if len(prompts) == 1 else "prompt"
            raise APIError(
                400,
                f"{what}: at most {most} generations a request (--parallel "
                f"{self.slots.parallel} at once, --queue {self.slots.queue} waiting), got "
                f"{len(prompts)} prompt(s) × {each} {runs}",
                param=what,
            )
        admitted = 0
        try:
            while admitted < total:
                self.slots.admit()
                admitted += 1
        except QueueFull:
            for _ in range(admitted):
                self.slots.release()
            raise APIError(
                503,
                f"the server is busy: {self.slots.running} generation(s) running and "
                f"{self.slots.waiting} waiting, the queue's limit (--queue); retry later",
                type=SERVER,
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        jobs: list[Job] = []
        handed_over = False

        def release() -> None:
            for job in jobs:
                self.scheduler.cancel(job)  # no-op for one that has ended
            for _ in range(total):
                self.slots.release()

        try:
            for prompt in prompts:
                own = {} if prompt is None else {"prompt": prompt}
                for i in range(runs):
                    seed = _choice_seed(kwargs.get("seed"), i)
                    choice = {**kwargs, **own, "model": self.alias, **seed}
                    jobs.append(self.scheduler.submit(method, choice))
            # each waits in line for a slot first; a stream starts once its first choice has
            # (the others' refusals, as for any error after the headers, are error events)
            for job in jobs[:1] if body.stream else jobs:
                event = await self._unless_gone(request, job)
                if event is None:
                    return Response(status_code=499)  # it left while queued: nobody to answer
                kind, value, _ = event
                if kind == "error":  # refused before anything ran: a 4xx naming the field
                    raise from_engine(value, fields, roles) from value
            if not body.stream:
                whole = []
                for job in jobs:
                    event = await self._unless_gone(request, job)
                    if event is None:
                        return Response(status_code=499)  # it left: the release ends the rest
                    kind, value, t = event
                    if kind == "error":
                        raise from_engine(value, fields, roles) from value
                    whole.append((value, t))
                if runs > n:
                    asked = isinstance(body, CompletionRequest) and body.logprobs is not None
                    return JSONResponse(_merged(whole, runs, _best(whole, runs, n, asked)))
                return JSONResponse(_merged(whole, n))
            handed_over = True
            usage_chunk = bool(body.stream_options and body.stream_options.include_usage)
            return _SlotStream(self._events(jobs, n, fields, roles, usage_chunk), release)
        finally:
            if not handed_over:
                release()

    async def _unless_gone(self, request: Request, job: Job) -> tuple[str, Any, Any] | None:
        """The job's next event, or None once the client has gone (looked at every
        ``DISCONNECT_POLL`` seconds while it waits)."""
        event = asyncio.ensure_future(job.next())
        while True:
            done, _ = await asyncio.wait({event}, timeout=DISCONNECT_POLL)
            if done:
                return event.result()
            if await request.is_disconnected():
                event.cancel()
                return None

    async def _events(
        self, jobs: list[Job], n: int, fields: set[str], roles: dict[str, str], usage_chunk: bool
    ) -> AsyncIterator[str]:
        """``data: {chunk}`` per chunk, ``data: [DONE]`` at the end. Each choice's chunks carry
        its index and the first choice's id; the chunk with the last finish reason carries
        ``usage`` (of every choice, ``n`` a prompt) and ``timings`` (as llama.cpp's server
        sends them), and with ``usage_chunk`` (OpenAI's ``include_usage``) one more chunk
        follows it, with no choices and the usage. A client that goes away cancels this body,
        and the release ends the generations at once."""
        pending = {i: asyncio.ensure_future(job.next()) for i, job in enumerate(jobs)}
        closing: dict[int, dict[str, Any]] = {}  # each choice's chunk with its finish reason
        usage: dict[int, dict[str, int]] = {}
        rid: str | None = None
        try:
            while pending:
                done, _ = await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
                for i in sorted(i for i, f in pending.items() if f in done):
                    kind, value, t = pending.pop(i).result()
                    if kind == "started":  # a choice that waited for a slot
                        pending[i] = asyncio.ensure_future(jobs[i].next())
                    elif kind == "chunk":
                        pending[i] = asyncio.ensure_future(jobs[i].next())
                        rid = rid or value["id"]
                        value["id"] = rid
                        for c in value["choices"]:
                            c["index"] = i
                        if (
                            value["choices"]
                            and value["choices"][0].get("finish_reason") is not None
                        ):
                            closing[i] = value  # sent when it ends, the last with the usage
                        else:
                            yield _sse(value)
                    elif kind == "end":
                        usage[i] = value
                        last = closing.pop(i, None)
                        if pending and last is not None:
                            yield _sse(last)
                        elif last is not None:
                            total = _total_usage(usage, n)
                            last["usage"] = total
                            last["timings"] = timings(t)
                            yield _sse(last)
                            if usage_chunk:
                                head = {k: last[k] for k in ("id", "object", "created", "model")}
                                yield _sse({**head, "choices": [], "usage": total})
                    else:  # after the headers: an error event ends it
                        yield _sse(from_engine(value, fields, roles).body())
                        return
            yield "data: [DONE]\n\n"
        finally:
            for f in pending.values():
                f.cancel()


def _sse(event: dict[str, Any]) -> str:
    """One server-sent event of JSON."""
    return f"data: {json.dumps(event)}\n\n"


def _choice_seed(seed: int | None, i: int) -> dict[str, int]:
    """The seed of choice ``i`` of ``n``: the request's seed plus ``i`` (so a seeded request
    with ``n`` choices repeats, and its choices differ); a random one stays random."""
    if i == 0 or seed is None or seed < 0:
        return {}
    return {"seed": (seed + i) % 2**64}


def _bias_by_text(model: weightlift.Model, bias: dict[str, float]) -> dict[str, float]:
    """``logit_bias`` keyed by text (llama-cpp-python's ``logit_bias_type="tokens"``) keyed by
    token id: each key's tokens (no BOS, special tokens parsed) take its bias, a later key's
    over an earlier one's where they share a token, as llama-cpp-python's server does."""
    by_id: dict[str, float] = {}
    for text, value in bias.items():
        for i in model.tokenize(text.encode(), add_bos=False, special=True):
            by_id[str(i)] = value
    return by_id


def _candidates(body: _Sampling) -> int:
    """The generations a prompt of ``body`` runs: ``n``, or a completion's ``best_of`` when
    it is larger (OpenAI's rules: at least ``n``, not streamed)."""
    best_of = body.best_of if isinstance(body, CompletionRequest) else None
    if best_of is None or best_of <= 1:
        return body.n
    if best_of < body.n:
        raise APIError(
            400,
            f"best_of: the candidates to choose n={body.n} choices from must be at least n, "
            f"got {best_of}",
            param="best_of",
        )
    if body.stream:
        raise APIError(
            400,
            f"best_of: {best_of} candidates are chosen from once they have all ended, so they "
            "cannot be streamed; leave out stream or best_of",
            param="best_of",
        )
    return best_of


def _best(
    whole: list[tuple[dict[str, Any], Any]], runs: int, n: int, keep_logprobs: bool
) -> list[tuple[dict[str, Any], Any]]:
    """The ``n`` best of each prompt's ``runs`` candidates (``whole`` prompt by prompt), best
    first: OpenAI's ``best_of`` rule, the highest log-probability per generated token (the
    mean of the last ``completion_tokens`` of ``token_logprobs``, so an echoed prompt's
    scores do not count; a candidate without tokens scores 0). Ties keep the candidates'
    order. Their ``logprobs`` go unless the request asked for them."""

    def score(value: dict[str, Any]) -> float:
        done = value["usage"]["completion_tokens"]
        scores = value["choices"][0]["logprobs"]["token_logprobs"]
        own = [v for v in scores[max(len(scores) - done, 0) :] if v is not None] if done else []
        return sum(own) / len(own) if own else 0.0

    picked = []
    for p in range(0, len(whole), runs):
        group = whole[p : p + runs]
        ranked = sorted(range(runs), key=lambda i: -score(group[i][0]))
        for i in ranked[:n]:
            value, t = group[i]
            if not keep_logprobs:
                for c in value["choices"]:
                    c["logprobs"] = None
            picked.append((value, t))
    return picked


def _total_usage(usages: dict[int, dict[str, int]], n: int) -> dict[str, int]:
    """The usage of a request's choices, by index (``n`` a prompt): each prompt once, every
    choice's completion."""
    prompt = sum(u["prompt_tokens"] for i, u in usages.items() if i % n == 0)
    completion = sum(u["completion_tokens"] for u in usages.values())
    return {
        **usages[min(usages)],
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _merged(
    whole: list[tuple[dict[str, Any], Any]],
    n: int,
    shown: list[tuple[dict[str, Any], Any]] | None = None,
) -> dict[str, Any]:
    """One response of a request's generations (the whole result of each, with its timings,
    ``n`` a prompt): the first's, with the choices of ``shown`` (by default all of them) each
    at its index, the usage of all (best_of's candidates are all counted, as OpenAI counts
    them), and the last one's timings."""
    shown = whole if shown is None else shown
    choices = []
    for i, (value, _) in enumerate(shown):
        for c in value["choices"]:
            c["index"] = i
            choices.append(c)
    usage = _total_usage({i: value["usage"] for i, (value, _) in enumerate(whole)}, n)
    return {**whole[0][0], "choices": choices, "usage": usage, "timings": timings(whole[-1][1])}


# What a client may reach without the API key: the liveness check (as llama.cpp's server
# leaves it open, for load balancers and container probes).
OPEN_PATHS = frozenset({"/health"})


def _require_key(app: FastAPI, key: str) -> None:
    """Answer 401 to a request without ``key`` as ``Authorization: Bearer <key>`` (what
    OpenAI's client sends) or ``X-Api-Key`` (llama.cpp's server takes both). A CORS preflight
    carries no key and is answered by the CORS layer around this one."""

    @app.middleware("http")
    async def check_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path in OPEN_PATHS or request.method == "OPTIONS":
            return await call_next(request)
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
        if not given:
            message = "missing API key: send it as the header Authorization: Bearer <key>"
        elif not secrets.compare_digest(given.encode(), key.encode()):
            message = "invalid API key: the key sent is not the one this server was started with"
        else:
            return await call_next(request)
        headers = {"WWW-Authenticate": "Bearer"}
        return APIError(401, message, code="invalid_api_key", headers=headers).response()


def create_app(
    model: weightlift.Model,
    *,
    alias: str,
    parallel: int,
    queue: int,
    embedding: bool,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``model`` as ``alias`` (embeddings too when ``embedding``); with
    ``api_key``, every endpoint but ``/health`` asks for it. Any web page may call it (CORS
    allows every origin, as llama-cpp-python's and llama.cpp's servers do): the key, not the
    origin, is what guards it."""
    server = Server(model, alias, parallel, queue, embedding)
    app = FastAPI(title="weightlift", version=weightlift.__version__)
    app.state.server = server
    install(app)
    if api_key is not None:
        _require_key(app, api_key)
    # added last, so it wraps the key check: preflights and 401s carry its headers
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]
    )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        slots = server.slots
        return {"status": "ok", "running": slots.running, "waiting": slots.waiting}

    @app.get("/memory")
    async def memory() -> dict[str, Any]:
        return {"devices": await server.scheduler.call(_memory)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_entry(alias)]}

    @app.get("/v1/models/{name:path}")
    async def model_by_id(name: str) -> dict[str, Any]:
        return server.model_entry(name)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await server.embed(body)

    # The tokenizer's extras, as llama-cpp-python's server has them: tokenize with BOS as the
    # vocabulary asks and special tokens parsed, detokenize without special tokens. The
    # tokenizer itself is safe to share between threads, but it is reached through the model's
    # lock, which a batch step holds while it runs, so these go to the engine thread too.
    @app.post("/extras/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        server._check_model(body.model)
        fields = set(TokenizeRequest.model_fields)
        ids = await server.call(
            lambda m: m.tokenize(body.input, add_bos=None, special=True), fields, "input"
        )
        return {"tokens": ids}

    @app.post("/extras/tokenize/count")
    async def count(body: TokenizeRequest) -> dict[str, Any]:
        return {"count": len((await tokenize(body))["tokens"])}

    @app.post("/extras/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        server._check_model(body.model)
        fields = set(DetokenizeRequest.model_fields)
        text = await server.call(lambda m: m.detokenize(body.tokens), fields, "tokens")
        return {"text": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        roles = {"prompt": "prompt", "grammar": "grammar"}
        return await server.generate(request, body, "create_completion", roles)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        roles = {"prompt": "messages", "grammar": _grammar_field(body)}
        return await server.generate(request, body, "create_chat_completion", roles)

    return app


def _grammar_field(body: ChatCompletionRequest) -> str:
    """The field a chat's grammar comes from, which its errors name: ``grammar`` when given,
    else ``response_format``'s schema, else the parameters schema of the tool (or legacy
    function) that ``tool_choice`` (``function_call``) names."""
    if body.grammar:
        return "grammar"
    if body.response_format:
        return "response_format"
    if isinstance(body.tool_choice, dict):
        return "tools"
    return "functions" if isinstance(body.function_call, dict) else "grammar"
