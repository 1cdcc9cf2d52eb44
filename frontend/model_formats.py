"""What the served model writes besides plain text, resolved once at start-up: its
thinking markers (``--reasoning-parser``, frontend/reasoning.py) and its tool-call
format (``--tool-call-parser``, frontend/tool_formats.py), each by default the one its
chat template implies; the thinking budgets ``reasoning_effort`` maps to; and the
special tokens the detokenizer must keep because a parser reads them (Llama 3's
``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from frontend.reasoning import PARSERS, ThinkFormat, default_parser
from frontend.tool_formats import FORMATS, default_format, markers

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

# reasoning_effort -> thinking tokens, where the request gives no max_reasoning_tokens
DEFAULT_EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": 8192}
EFFORTS = tuple(DEFAULT_EFFORT_BUDGETS)


@dataclass(frozen=True)
class ModelFormats:
    thinking: ThinkFormat | None = None
    start_ids: tuple[int, ...] = ()  # the thinking markers as token ids
    end_ids: tuple[int, ...] = ()
    tool_parser: str = "hermes"
    effort_budgets: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_EFFORT_BUDGETS))
    keep_special: frozenset[int] = frozenset()  # special tokens parsers read

    @classmethod
    def resolve(
        cls,
        tokenizer: Tokenizer,
        reasoning_parser: str = "auto",
        tool_parser: str = "auto",
        effort_budgets: dict[str, int] | None = None,
    ) -> ModelFormats:
        template = getattr(tokenizer.hf_tokenizer, "chat_template", None)
        if not isinstance(template, str):
            template = None
        name = default_parser(template) if reasoning_parser == "auto" else reasoning_parser
        if name not in (None, "none") and name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(PARSERS)}")
        thinking = PARSERS[name] if name not in (None, "none") else None
        tools = default_format(template) if tool_parser == "auto" else tool_parser
        if tools not in FORMATS:
            raise ValueError(f"unknown tool-call parser {tools!r}: one of {', '.join(FORMATS)}")
        keep = set()
        for marker in markers(tools) + ((thinking.start, thinking.end) if thinking else ()):
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in tokenizer.special_token_ids:
                keep.add(ids[0])
        budgets = dict(DEFAULT_EFFORT_BUDGETS) | (effort_budgets or {})
        return cls(
            thinking,
            tuple(tokenizer.encode(thinking.start, add_special_tokens=False)) if thinking else (),
            tuple(tokenizer.encode(thinking.end, add_special_tokens=False)) if thinking else (),
            tools,
            budgets,
            frozenset(keep),
        )
