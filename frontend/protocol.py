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

Then (`prepare_chat`, `prepare_completion`) from a validated body to what the decode pool
runs: prompt ids and sampling.

Here the chat template is applied and the prompt tokenized, the API's parameters are
mapped to the wire's :class:`SamplingParams`, and what cannot be served is refused
with a 400 naming the field: unsupported options, malformed ``logit_bias`` or output
constraints, and prompts that do not fit the context window together with ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from engine.grammar import GrammarCompiler
from engine.tokenizer import ChatTemplateError, Tokenizer
from frontend.body_scan import text_bounds
from frontend.errors import BadRequest
from frontend.model_formats import ModelFormats
from frontend.reasoning import ThinkFormat
from frontend.structured import CONSTRAINT_FIELDS, Constraint, find_constraint, grammar_for
from frontend.tools import (
    ToolMode,
    check_tools,
    constraint,
    template_renders_tools,
    with_tools_in_prompt,
)
from protocol.declare import bounds, hints
from protocol.lora import AdapterRef
from protocol.sampling import MAX_INT32, MAX_LOGPROBS, SamplingParams
from runtime.errors import InvalidInput

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
    # structured output (frontend/structured.py, CONSTRAINT_FIELDS)
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
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # reach the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


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


MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # stop strings and logprobs included
    stream: bool
    include_usage: bool
    echo_text: str | None = None  # completions with echo: the prompt, as text
    priority: int = 0  # lower runs first under the priority scheduling policy
    user: str | None = None  # the client's end-user id (a session hint for routing)
    api_key: str | None = None  # the name of the API key it came with (frontend/auth.py)
    tool_mode: ToolMode | None = None  # tool calls are parsed from the output
    thinking: ThinkFormat | None = None  # a reasoning model's markers: thinking is split off
    keep_special: frozenset[int] = frozenset()  # special tokens the output text keeps
    n: int = 1  # choices (frontend/generation.py, Choices)
    lora: AdapterRef | None = None  # the LoRA adapter the request's `model` names


# what the frontend itself gives the template, and apply_chat_template's own options:
# not a request's chat_template_kwargs
_TEMPLATE_OWN = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
     "chat_template", "continue_final_message", "sanitize_control_tokens", "padding",
     "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def prepare_chat(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int | None,
    grammar: GrammarCompiler | None = None,
    formats: ModelFormats | None = None,
) -> PreparedRequest:
    """``formats``: what the model writes besides text (default: no thinking, Hermes
    tool calls)."""
    _check_common(body)
    formats = formats or ModelFormats()
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    # a request that names no tools and no tool_choice has no tool mode to check
    asks_tools = body.tools is not None or body.tool_choice is not None
    mode = None
    if asks_tools:
        mode = check_tools(
            body.tools, body.tool_choice, formats.tool_parser, body.parallel_tool_calls
        )
    messages = [chat_message(m.model_dump(exclude_none=True)) for m in body.messages]
    check_prompt_chars(message_chars(messages), tokenizer, max_model_len, "messages")
    tools = body.tools if mode is not None else None
    if tools and not template_renders_tools(getattr(tokenizer.hf_tokenizer, "chat_template", None)):
        messages, tools = with_tools_in_prompt(messages, tools), None
    kwargs = body.chat_template_kwargs or {}
    own = sorted(_TEMPLATE_OWN & kwargs.keys())
    if own:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(own)}", param="chat_template_kwargs"
        )
    try:
        text = tokenizer.render_chat(
            messages, add_generation_prompt=body.add_generation_prompt, tools=tools, **kwargs
        )
    except ChatTemplateError as e:
        raise BadRequest(str(e), param="messages") from None
    except ValueError as e:  # the tokenizer's message and content-part checks
        raise BadRequest(str(e), param="messages") from None
    asked = getattr(body, "max_reasoning_tokens", None)
    budget = thinking_budget(formats, asked, body.reasoning_effort)
    thinking, opened = formats.thinking, False
    if thinking is not None:
        opened = thinking.opened_by(text)
        closed = text.rstrip().endswith(thinking.end)  # e.g. Qwen3's enable_thinking=False
        if budget is not None and not opened and not closed and body.add_generation_prompt:
            text += thinking.start + "\n"  # open the block, so the budget counts from here
            opened = True
    ids = tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    limits = (tokenizer.vocab_size, max_model_len)
    markers = _markers(formats, budget, opened)
    prepared = _prepared(body, tuple(ids), max_tokens, top, limits, "messages", param, markers)
    prepared = dataclasses.replace(
        prepared, tool_mode=mode, thinking=thinking, keep_special=formats.keep_special
    )
    tool_constraint = constraint(mode, body.tools or []) if mode is not None else None
    return _constrained(prepared, body, grammar, tool_constraint)


def prepare_completion(
    body: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int | None,
    grammar: GrammarCompiler | None = None,
    formats: ModelFormats | None = None,
) -> PreparedRequest:
    _check_common(body)
    if body.best_of is not None and body.best_of != 1:
        raise BadRequest("best_of > 1 is not supported", param="best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    ids, text = _prompt(body.prompt, tokenizer, max_model_len)
    limits = (tokenizer.vocab_size, max_model_len)
    formats = formats or ModelFormats()
    budget = thinking_budget(formats, getattr(body, "max_reasoning_tokens", None), None)
    opened = False
    if formats.thinking is not None:
        prompt = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
        opened = formats.thinking.opened_by(prompt)
    markers = _markers(formats, budget, opened)
    prepared = _prepared(
        body, ids, body.max_tokens, body.logprobs, limits, "prompt", "max_tokens", markers
    )
    prepared = dataclasses.replace(prepared, keep_special=formats.keep_special)
    if body.echo:
        if body.logprobs is not None:
            raise BadRequest(
                "echo with logprobs is not supported (prompt logprobs are not computed)",
                param="echo",
            )
        skip = prepared.sampling.skip_special_tokens
        echo = text if text is not None else tokenizer.decode(ids, skip)
        prepared = dataclasses.replace(prepared, echo_text=echo)
    return _constrained(prepared, body, grammar)


def _constrained(
    prepared: PreparedRequest,
    body: _Sampling,
    compiler: GrammarCompiler | None,
    tool_constraint: Constraint | None = None,
) -> PreparedRequest:
    """``prepared`` with the body's output constraint compiled into its sampling."""
    found = find_constraint(body) if body.model_fields_set & CONSTRAINT_FIELDS else None
    if found is not None and tool_constraint is not None:
        raise BadRequest(
            "tool_choice 'required' or a named tool cannot be combined with another output "
            "constraint",
            param=found.param,
        )
    found = found or tool_constraint
    if found is None:
        return prepared
    if compiler is None:
        raise BadRequest("structured output is not available here", param=found.param)
    grammar = grammar_for(compiler, found)
    sampling = dataclasses.replace(prepared.sampling, grammar=grammar)
    return dataclasses.replace(prepared, sampling=sampling)


def thinking_budget(
    formats: ModelFormats, max_reasoning_tokens: int | None, effort: str | None
) -> int | None:
    """A request's thinking budget; a 400 for ``max_reasoning_tokens`` on a model that
    does not think (``reasoning_effort`` is ignored there, as clients send it to any
    model)."""
    if formats.thinking is None:
        if max_reasoning_tokens is not None:
            raise BadRequest(
                "max_reasoning_tokens is for reasoning models: this model has no thinking "
                "markers (serve it with --reasoning-parser)",
                param="max_reasoning_tokens",
            )
        return None
    if max_reasoning_tokens is not None:
        return max_reasoning_tokens
    if effort is None:
        return None
    return formats.effort_budgets[effort]


def _markers(formats: ModelFormats, budget: int | None, opened: bool) -> dict[str, Any]:
    """The sampling fields of a reasoning model's thinking (engine/reasoning.py)."""
    if formats.thinking is None:
        return {}
    return {
        "max_reasoning_tokens": budget,
        "reasoning_start": formats.start_ids,
        "reasoning_end": formats.end_ids,
        "reasoning_open": opened,
    }


def _check_common(body: _Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "developer":  # OpenAI's newer name for the system role
        message["role"] = "system"
    return message


def check_prompt_chars(
    chars: int,
    tokenizer: Tokenizer,
    max_model_len: int | None,
    param: str,
    *,
    at_least: bool = False,
) -> None:
    """Refuse, before tokenizing it, a prompt of more characters than any prompt that fits
    the context window can have (``max_model_len`` tokens of the longest token's
    characters): tokenizing a 30 MB prompt only to count it took the frontend a minute."""
    if max_model_len is None:
        return
    limit = max_model_len * tokenizer.max_token_chars
    if chars > limit:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {'at least ' if at_least else ''}{chars} characters, more than "
            f"{limit}, the most that {max_model_len} tokens of this tokenizer can spell.",
            param=param,
            code="context_length_exceeded",
        )


_TEXT_PATHS = {
    "prompt": (("prompt",), ("prompt", "*")),
    "messages": (("messages", "*", "content"), ("messages", "*", "content", "*", "text")),
}


def refuse_oversized_body(
    body: bytes, fields: tuple[str, ...], tokenizer: Tokenizer, max_model_len: int | None
) -> None:
    """The character bound, applied before validation to a body big enough to be over it:
    validating a 30 MB prompt took longer than everything else its refusal costs. The
    raw spans of the text's string literals (``frontend/body_scan.py``) settle most
    bodies without decoding a string; the rest are parsed with CPython's JSON scanner
    (about half the time of the request models' validation) and counted exactly.
    ``fields`` names where the body's text is: "prompt" (a string or a list of them) and
    "messages". A body this does not understand is left to the validation that follows."""
    if max_model_len is None:
        return
    limit = max_model_len * tokenizer.max_token_chars
    if len(body) <= limit:
        return  # whatever it holds, no prompt in it is over the bound
    settled = True
    for field in fields:
        bounds = text_bounds(body, _TEXT_PATHS[field])
        if bounds is not None and bounds[0] > limit:
            check_prompt_chars(bounds[0], tokenizer, max_model_len, field, at_least=True)
        settled = settled and bounds is not None and bounds[1] <= limit
    if settled:
        return  # the text is within the bound whatever its escapes decode to
    try:
        obj = json.loads(body)
    except ValueError:
        return
    if not isinstance(obj, dict):
        return
    for field in fields:
        value = obj.get(field)
        if field == "messages":
            if isinstance(value, list) and all(isinstance(m, dict) for m in value):
                check_prompt_chars(message_chars(value), tokenizer, max_model_len, field)
            continue
        texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        for text in texts:
            if isinstance(text, str):
                check_prompt_chars(len(text), tokenizer, max_model_len, field)


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the text the messages carry (what a chat template renders at least)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))  # fmt: skip
    return total


def _prompt(
    prompt: str | list[int] | list[str] | list[list[int]],
    tok: Tokenizer,
    max_model_len: int | None,
) -> tuple[tuple[int, ...], str | None]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(
                "a batch of prompts is not supported: send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        check_prompt_chars(len(prompt), tok, max_model_len, "prompt")
        return tuple(tok.encode(prompt)), prompt
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    vocab = tok.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]  # type: ignore[operator]
    if bad:
        raise BadRequest(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt")
    return tuple(prompt), None  # type: ignore[arg-type]


def _named(message: str, names: tuple[str, ...]) -> str | None:
    """The field a declaration's message is about (it starts with the name)."""
    return next((n for n in names if message.startswith(n)), None)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` with the ids as integers, checked."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias has at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < vocab:
            raise BadRequest(
                f"logit_bias keys must be token ids in [0, {vocab}); got {key!r}",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise BadRequest(
                f"logit_bias values must be in [-100, 100]; got {value} for {key}",
                param="logit_bias",
            )
        out[int(key)] = float(value)
    return out


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    items = [s for s in items if s]  # an empty stop string would stop at once: ignore it
    return tuple(dict.fromkeys(items))


def _prepared(
    body: _Sampling,
    ids: tuple[int, ...],
    max_tokens: int | None,
    top_logprobs: int | None,
    limits: tuple[int, int | None],
    prompt_param: str,
    max_tokens_param: str,
    markers: dict[str, Any] | None = None,
) -> PreparedRequest:
    vocab_size, max_model_len = limits
    n = len(ids)
    if n == 0:
        raise BadRequest("the prompt is empty after tokenization", param=prompt_param)
    if max_model_len is not None:
        if n >= max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt has {n} tokens; shorten it to at most {max_model_len - 1}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and n + max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for "
                f"the completion). Reduce {max_tokens_param} to at most {max_model_len - n}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
    bias = _logit_bias(body.logit_bias, vocab_size)
    stop_ids = tuple(getattr(body, "stop_token_ids", None) or ())
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"stop_token_ids must be in [0, {vocab_size}); got {bad[:5]}", param="stop_token_ids"
        )
    same_names = {k: v for k in SAMPLING_API if (v := getattr(body, k)) is not None}
    same_names |= markers or {}
    try:
        sampling = SamplingParams(
            **same_names,
            max_tokens=max_tokens,
            stop=_stops(body.stop),
            logprobs=top_logprobs,
            logit_bias=bias,
        )
    except InvalidInput as e:
        raise BadRequest(str(e), param=_named(str(e), ("stop", *SAMPLING_API))) from None
    return PreparedRequest(
        prompt_token_ids=ids,
        sampling=sampling,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        priority=body.priority,
        user=body.user,
        n=body.n,
    )
