"""vLLM's ``/tokenize`` and ``/detokenize``, in its shapes.

``POST /tokenize`` takes ``{"prompt": text}`` (``add_special_tokens``, default true) or
``{"messages": [...]}`` (rendered through the chat template; ``add_generation_prompt``,
default true, and ``tools``), with ``return_token_strs`` for the tokens' strings, and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``. ``POST /detokenize``
takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. ``model`` is optional in
both; when given it must name the served model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from frontend.errors import BadRequest
from frontend.protocol import (
    ChatMessage,
    _Strict,
    chat_message,
    check_prompt_chars,
    message_chars,
    parse,
    refuse_oversized_body,
)
from frontend.serving import FrontendState

MAX_TOKENS = 1 << 20


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS)


def tokenize(state: FrontendState, body: bytes) -> dict[str, Any]:
    refuse_oversized_body(body, ("prompt", "messages"), state.tokenizer, state.max_model_len())
    req = parse(TokenizeRequest, body)
    if req.model is not None:
        state.check_model(req.model)
    tok = state.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt and messages", param="prompt")
    limit = state.max_model_len()
    if req.prompt is not None:
        check_prompt_chars(len(req.prompt), tok, limit, "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt, add_special_tokens=special)
    else:
        messages = [chat_message(m.model_dump(exclude_none=True)) for m in req.messages or ()]
        check_prompt_chars(message_chars(messages), tok, limit, "messages")
        try:
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools
            )
        except ValueError as e:  # ChatTemplateError and the content checks
            raise BadRequest(str(e), param="messages") from None
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len(),
        "tokens": list(ids),
        "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize(state: FrontendState, body: bytes) -> dict[str, Any]:
    req = parse(DetokenizeRequest, body)
    if req.model is not None:
        state.check_model(req.model)
    vocab = state.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"tokens must be token ids in [0, {vocab}); got {bad[:5]}", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}
