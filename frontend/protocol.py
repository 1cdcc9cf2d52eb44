"""The request bodies of the OpenAI API, as pydantic models, and their parsing.

Types are strict (a number given as a string, a boolean given as 1 are refused); the
sampling fields, their types and ranges come from their one declaration,
`protocol.sampling.SamplingParams` (those marked ``api=True`` there are taken under the
same names); fields this frontend does not know are ignored, as OpenAI does.
Extensions in the manner of vLLM: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``structured_outputs`` and ``guided_*`` (structured
output, frontend/structured.py), ``priority`` (lower runs first on workers started with
``--scheduling-policy priority``; ignored under FCFS), ``num_speculative_tokens``
(prompt-lookup drafts a step for a greedy request; unset: the worker's
``--num-speculative-tokens``, 0: off).

:func:`parse` turns a body into a model or raises :class:`BadRequest` naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from frontend.errors import BadRequest
from protocol.declare import bounds, hints
from protocol.sampling import MAX_INT32, MAX_LOGPROBS, SamplingParams

MAX_TOP_LOGPROBS = MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def sampling_field(name: str) -> tuple[Any, Any]:
    """The request field for one of :class:`SamplingParams`' fields, from its declaration:
    its type made optional (None: the declared default), a list where it holds a tuple,
    its range and its help."""
    f = next(f for f in dataclasses.fields(SamplingParams) if f.name == name)
    b, hint = bounds(f), hints(SamplingParams)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    ranged: dict[str, Any] = {}
    if b.lo is not None:
        ranged["gt" if b.lo_open else "ge"] = b.lo
    if b.hi is not None:
        ranged["le"] = b.hi
    sized: dict[str, Any] = {}
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        hint = list[Annotated[item, Field(**ranged)]] if ranged else list[item]  # type: ignore[valid-type]
        ranged, sized = {}, {"max_length": b.max_items}
    return hint | None, Field(None, description=f.metadata.get("help") or None, **ranged, **sized)


# Request fields the API shares with SamplingParams under the same names (api=True there).
SAMPLING_API = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.metadata.get("api"))

if TYPE_CHECKING:
    _SamplingFields = _Strict
else:
    _SamplingFields = create_model(
        "_SamplingFields", __base__=_Strict, **{n: sampling_field(n) for n in SAMPLING_API}
    )


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) reach the chat template.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class _Sampling(_SamplingFields):
    """The fields both endpoints share: those of SamplingParams with the same name and
    shape (`SAMPLING_API`, generated above), and these, whose API shape differs."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = sampling_field("max_tokens")[1]
    stop: str | list[str] | None = None
    priority: int = Field(0, ge=-(2**31), le=MAX_INT32)
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
    max_completion_tokens: int | None = sampling_field("max_tokens")[1]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # The API's default is 16, not "until the context is full".
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = sampling_field("logprobs")[1]
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
