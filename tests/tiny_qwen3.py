"""A tiny Qwen3 of random weights with a chat template in Qwen3's manner, made at test
time: SmolLM2's tokenizer plus Qwen3's added (not special) tokens ``<think>``,
``</think>``, ``<tool_call>`` and ``</tool_call>``, and a ChatML template that renders
tools in the Hermes form, drops earlier turns' thinking and, with ``enable_thinking``
false, writes an empty thinking block after the generation prompt. The template is
written here, in Qwen3's manner, not copied. A random model seldom closes its own
thinking, so a budget is what ends it (issue 43's tests)."""

from __future__ import annotations

from pathlib import Path

import torch

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

TEMPLATE = """\
{%- set system = messages[0].content if messages[0].role == 'system' else none -%}
{%- if tools or system is not none -%}
<|im_start|>system
{% if system is not none %}{{ system }}{% endif %}
{%- if tools %}

# Tools

You may call functions. Their signatures, one per line, in <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Write each call as a JSON object in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- elif m.role == 'assistant' -%}
{%- set content = m.content or '' -%}
{%- if '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip() -%}
{%- endif -%}
<|im_start|>assistant
{{ content }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


def tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """The model and its tokenizer, saved as an HF directory at `path`."""
    import transformers

    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None).hf_tokenizer
    tok.add_tokens(MARKERS)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path
