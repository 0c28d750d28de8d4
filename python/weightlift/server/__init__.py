"""``weightlift serve``: an OpenAI-compatible HTTP server over one loaded ``Model``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as Server-
Sent Events), ``POST /v1/embeddings`` (when asked for), ``GET /v1/models``, ``GET
/v1/models/{id}``, llama-cpp-python's tokenizer extras ``POST /extras/tokenize``,
``/extras/tokenize/count`` and ``/extras/detokenize``, and ``GET /health``. Request fields are
llama-cpp-python's server's (``llama_cpp/server/types.py``), with OpenAI's embedding request
(token ids, ``base64``); every completion carries ``usage`` and llama.cpp's server's
``timings``.

The HTTP stack is FastAPI on uvicorn: the one llama-cpp-python's and vLLM's servers use, well
kept, with request validation by pydantic and SSE through ``StreamingResponse``. Generations run
on an engine thread while the event loop keeps serving: the engine releases the GIL as it computes.

``parallel`` generations run at once on one engine thread, stepped together (continuous
batching: one forward call a token for all of them, new requests joining between steps), each
in a slot, a KV cache of the model's context length that keeps its tokens, so a prompt sharing
a prefix with the slot's last one runs only the rest. The other requests wait in a bounded
first-come-first-served queue (``queue``), beyond which they get 503. With an API key, every
endpoint but ``/health`` answers 401 without it; CORS allows every origin. Embeddings and the
tokenizer take no slot: they run on the engine thread between steps, an embedding in the one
more cache of the context's length that ``weightlift serve --embedding`` plans beside the
slots.
FastAPI and uvicorn are the ``server`` extra: ``pip install weightlift[server]``.
"""

from __future__ import annotations

import importlib.util
import signal
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import weightlift

# Seconds uvicorn lets in-flight requests finish after SIGINT/SIGTERM before it cancels them
# (a cancelled stream stops at its next token).
GRACEFUL_SECONDS = 10


def require() -> None:
    """Raise ImportError naming the extra when FastAPI or uvicorn is missing."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"weightlift serve needs {' and '.join(missing)}, which are not installed; "
            "run `pip install weightlift[server]`"
        )


def create_app(
    model: weightlift.Model,
    *,
    alias: str,
    parallel: int = 1,
    queue: int = 16,
    embedding: bool = False,
    api_key: str | None = None,
) -> Any:
    """The FastAPI app serving ``model`` under the name ``alias``; ``embedding`` serves
    ``/v1/embeddings`` too (load the model with one planned sequence beyond ``parallel`` for
    them, as ``weightlift serve --embedding`` does, or each embedding makes a cache of its own
    for its call); with ``api_key`` every endpoint but ``/health`` asks for it."""
    require()
    from weightlift.server.app import create_app as create

    return create(
        model, alias=alias, parallel=parallel, queue=queue, embedding=embedding, api_key=api_key
    )


def serve(
    model: weightlift.Model,
    sock: socket.socket,
    *,
    alias: str,
    parallel: int = 1,
    queue: int = 16,
    embedding: bool = False,
    log_level: str = "info",
    graceful_seconds: float = GRACEFUL_SECONDS,
    api_key: str | None = None,
) -> None:
    """Serve ``model`` on the bound socket ``sock`` until SIGINT or SIGTERM, then return once
    uvicorn's graceful shutdown is over: in-flight requests finished, or cancelled once
    ``graceful_seconds`` have passed."""
    require()
    import uvicorn

    app = create_app(
        model, alias=alias, parallel=parallel, queue=queue, embedding=embedding, api_key=api_key
    )
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=graceful_seconds
    )
    # uvicorn raises the signal it caught again after its shutdown, for the handler it found;
    # this one takes it, so a stop by signal is a clean exit (status 0), not a death by SIGTERM.
    caught: list[int] = []
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda sig, _frame: caught.append(sig)) for s in handled}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.server.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["GRACEFUL_SECONDS", "create_app", "require", "serve"]
