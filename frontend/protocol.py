"""The request bodies of the OpenAI API, as pydantic models, and their parsing.

Types are strict (a number given as a string, a boolean given as 1 are refused) and
ranges are those of the OpenAI API; fields this frontend does not know are ignored,
as OpenAI does. Extensions in the manner of vLLM: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``structured_outputs`` and
``guided_*`` (structured output, frontend/structured.py), ``priority`` (lower runs first
on workers started with ``--scheduling-policy priority``; ignored under FCFS),
``num_speculative_tokens`` (prompt-lookup drafts a step for a greedy request; unset:
the worker's ``--num-speculative-tokens``, 0: off).

:func:`parse` turns a body into a model or raises :class:`BadRequest` naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from frontend.errors import BadRequest

MAX_INT32 = 2**31 - 1
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) reach the chat template.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=256)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=MAX_INT32)
    # speculative decoding by prompt lookup: drafts a step (None: the server's default)
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output (frontend/structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # The API's default is 16, not "until the context is full".
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


# What to say when a value fits none of a union's shapes.
_SHAPES = {
    "prompt": "prompt must be a string or a list of token ids",
    "stop": "stop must be a string or a list of strings",
    "content": "content must be a string or a list of content parts",
    "tool_choice": "tool_choice must be a string or an object",
}

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: bytes) -> M:
    """Validate a JSON body; raises :class:`BadRequest` for malformed JSON or bad fields."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _bad_request(e) from None


def _bad_request(e: ValidationError) -> BadRequest:
    err = e.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return BadRequest(f"the request body is not valid JSON: {err['msg']}", code="invalid_json")
    if not err["loc"]:
        return BadRequest("the request body must be a JSON object", code="invalid_json")
    path = _param(err["loc"])
    field = next((p for p in reversed(err["loc"]) if isinstance(p, str) and p in _SHAPES), None)
    if field is not None and _is_union_branch(err["loc"]):
        return BadRequest(f"{path}: {_SHAPES[field]}", param=path)
    if kind == "missing":
        return BadRequest(f"{path} is required", param=path)
    return BadRequest(f"{path}: {err['msg']}", param=path)


def _is_union_branch(loc: tuple[int | str, ...]) -> bool:
    return any(isinstance(p, str) and (p in _TYPE_TAGS or "[" in p) for p in loc)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[int | str, ...]) -> str:
    """``messages[0].content`` from pydantic's location, without union branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part.startswith("function-"):
            continue
        else:
            out += f".{part}" if out else part
    return out
