"""The routes: completions and chat completions (plain or SSE), the model list and health."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import weightlift
from weightlift.server.errors import SERVER, APIError, from_engine, install
from weightlift.server.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from weightlift.server.slots import QueueFull, Slots


def timings(model: weightlift.Model) -> dict[str, float] | None:
    """The last generation's times, under llama.cpp's server's names."""
    t = model.timings
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


class _SlotStream(StreamingResponse):
    """An SSE response that gives its slot back once sent, cut off, or never started."""

    def __init__(self, body: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Sync on purpose: this also runs in a cancelled task. The engine step that was
            # running has returned by now (a worker thread is waited for, not abandoned).
            self._release()


class Server:
    """One model behind the slots; the routes' shared state."""

    def __init__(self, model: weightlift.Model, alias: str, parallel: int, queue: int) -> None:
        self.model = model
        self.alias = alias
        self.slots = Slots(parallel, queue)
        self.created = int(time.time())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.alias:
            raise APIError(
                404,
                f"model: '{name}' is not served here; this server serves '{self.alias}'",
                param="model",
                code="model_not_found",
            )

    async def generate(
        self, request: Request, body: _Sampling, method: str, roles: dict[str, str]
    ) -> Response:
        """Run ``model.<method>(**body.kwargs())`` in its turn; JSON, or SSE when streaming."""
        self._check_model(body.model)
        try:
            kwargs = body.kwargs()  # type: ignore[attr-defined]
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None
        fields = set(type(body).model_fields)
        call = getattr(self.model, method)

        def run() -> Any:
            try:
                out = call(**kwargs, model=self.alias)
                if not body.stream:
                    out["timings"] = timings(self.model)
                    return out
                return out, next(out, None)  # the prompt's errors come before the headers
            except Exception as e:
                raise from_engine(e, fields, roles) from e

        try:
            await self.slots.acquire()
        except QueueFull:
            raise APIError(
                503,
                f"the server is busy: {self.slots.running} generation(s) running and "
                f"{self.slots.waiting} waiting, the queue's limit (--queue); retry later",
                type=SERVER,
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        handed_over = False
        try:
            if await request.is_disconnected():
                return Response(status_code=499)  # it left while queued: nobody to answer
            result = await to_thread.run_sync(run)
            if not body.stream:
                return JSONResponse(result)
            stream, first = result
            handed_over = True
            return _SlotStream(self._events(request, stream, first, fields, roles), self.release)
        finally:
            if not handed_over:
                self.slots.release()

    def release(self) -> None:
        self.slots.release()

    async def _events(
        self,
        request: Request,
        stream: Any,
        chunk: dict[str, Any] | None,
        fields: set[str],
        roles: dict[str, str],
    ) -> AsyncIterator[str]:
        """``data: {chunk}`` per chunk, ``data: [DONE]`` at the end; the generation stops at
        the next token once the client is gone."""

        def step() -> Any:
            try:
                return next(stream, None)
            except Exception as e:
                return from_engine(e, fields, roles)

        while chunk is not None:
            if chunk["choices"] and chunk["choices"][0].get("finish_reason") is not None:
                chunk["timings"] = timings(self.model)
            yield f"data: {json.dumps(chunk)}\n\n"
            if await request.is_disconnected():
                return
            chunk = await to_thread.run_sync(step)
            if isinstance(chunk, APIError):  # after the headers: an error event ends it
                yield f"data: {json.dumps(chunk.body())}\n\n"
                return
        yield "data: [DONE]\n\n"


def create_app(model: weightlift.Model, *, alias: str, parallel: int, queue: int) -> FastAPI:
    """The FastAPI app serving ``model`` as ``alias``."""
    server = Server(model, alias, parallel, queue)
    app = FastAPI(title="weightlift", version=weightlift.__version__)
    app.state.server = server
    install(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        slots = server.slots
        return {"status": "ok", "running": slots.running, "waiting": slots.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": alias, "object": "model", "created": server.created, "owned_by": "me"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        roles = {"prompt": "prompt", "grammar": "grammar"}
        return await server.generate(request, body, "create_completion", roles)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        grammar = "response_format" if body.response_format and not body.grammar else "grammar"
        roles = {"prompt": "messages", "grammar": grammar}
        return await server.generate(request, body, "create_chat_completion", roles)

    return app
