"""The request bodies, with the field names and defaults of llama-cpp-python's server (its
``llama_cpp/server/types.py``), so a client written for that server sends the same JSON here.

Fields outside this list (``user``, ``service_tier``, ...) are ignored, as there. Some of
OpenAI's fields that llama-cpp-python's server ignores are taken as OpenAI's API defines them:
``n`` (choices, each in a slot of its own), ``best_of``, a list of prompts,
``max_completion_tokens`` (chat's name for ``max_tokens`` since the latter was deprecated
there) and ``stream_options.include_usage``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk, before ``[DONE]``,
    whose ``choices`` are empty and whose ``usage`` counts the request's tokens."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share. The sampling numbers must be finite: pydantic would
    otherwise take NaN or infinity and judge it against the bounds, which says the wrong thing."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(0.8, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(0.95, ge=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    # the engine's top_k is an i32
    top_k: int = Field(40, ge=0, le=2**31 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # -1 asks for a random seed, as in llama.cpp
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.1, ge=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # llama-cpp-python's own: "tokens" keys logit_bias by text, each of its tokens biased
    logit_bias_type: Literal["input_ids", "tokens"] | None = None
    mirostat_mode: int = Field(0, ge=0, le=2)
    mirostat_tau: float = Field(5.0, ge=0.0, le=10.0, allow_inf_nan=False)
    mirostat_eta: float = Field(0.1, ge=0.001, le=1.0, allow_inf_nan=False)
    grammar: str | None = None
    # choices, each generated in a slot of its own (at most --parallel)
    n: int = Field(1, ge=1)
    # tokens before an end-of-generation token may end the reply (a stop string, max_tokens
    # may end it sooner)
    min_tokens: int = Field(0, ge=0)

    def sampling(self) -> dict[str, Any]:
        """The keywords of ``Model.create_completion`` / ``create_chat_completion`` these set."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "stream": self.stream,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repeat_penalty": self.repeat_penalty,
            "logit_bias": self.logit_bias,
            "mirostat_mode": self.mirostat_mode,
            "mirostat_tau": self.mirostat_tau,
            "mirostat_eta": self.mirostat_eta,
            "grammar": self.grammar,
            "min_tokens": self.min_tokens,
        }


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    # A string or token ids, or a list of either: OpenAI's batch of prompts, each answered by
    # its own choices
    prompt: str | list[int] | list[str] | list[list[int]] = ""
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    # candidates a prompt, the n best returned (see the app's generate)
    best_of: int | None = Field(1, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: its one, or each of its list (none is one empty prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p or ""]  # type: ignore[list-item]

    def kwargs(self) -> dict[str, Any]:
        return {
            "prompt": self.prompts()[0],
            "suffix": self.suffix,
            "max_tokens": self.max_tokens,
            "echo": self.echo,
            "logprobs": self.logprobs,
            **self.sampling(),
        }


class ChatMessage(BaseModel):
    """One of a chat's messages: OpenAI's roles are checked here, the rest goes to the chat
    template as the client sent it."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=0)
    # OpenAI's name for max_tokens in chat; it wins where a client sends both
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    response_format: dict[str, Any] | None = None

    def kwargs(self) -> dict[str, Any]:
        return {
            "messages": [m.model_dump() for m in self.messages],
            "functions": self.functions,
            "function_call": self.function_call,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "max_tokens": (
                self.max_completion_tokens
                if self.max_completion_tokens is not None
                else self.max_tokens
            ),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "response_format": self.response_format,
            **self.sampling(),
        }


# The largest token id a request may hold: the ids are u32 in the engine.
MAX_ID = 2**32 - 1


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's request (llama-cpp-python's server takes strings only).

    ``input`` is checked by ``inputs()`` rather than by a pydantic union, so that a wrong type
    gets one message naming ``input`` and the four forms it may take.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: int | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a string or a list of token ids; ValueError naming ``input``."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if isinstance(given, list) and given and all(_is_id(t) for t in given):
            return [given]
        if isinstance(given, list) and given:
            one_kind = all(isinstance(x, str) for x in given) or all(
                isinstance(x, list) and x and all(_is_id(t) for t in x) for x in given
            )
            if one_kind:
                return list(given)
        if isinstance(given, list) and not given:
            raise ValueError("input: expected at least one input, got an empty list")
        raise ValueError(
            "input: expected a string, a list of strings, a list of token ids (integers from 0 "
            f"to {MAX_ID}) or a list of such lists, got {json.dumps(given)[:80]}"
        )


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_ID


class TokenizeRequest(BaseModel):
    """``POST /extras/tokenize`` and ``/extras/tokenize/count`` (llama-cpp-python's
    ``TokenizeInputRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str


class DetokenizeRequest(BaseModel):
    """``POST /extras/detokenize`` (llama-cpp-python's ``DetokenizeInputRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_ID)]]
