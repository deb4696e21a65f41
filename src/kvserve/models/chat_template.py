"""Gemma's chat format, shipped because llama.cpp's Gemma 3 GGUF carries no chat template.

Turns look like ``<start_of_turn>user\\n{content}<end_of_turn>\\n``; the assistant role is
called ``model``; a system message, which Gemma has no role for, is prepended to the first
user turn. The rendered string already starts with ``<bos>``, so encode it with
``add_special_tokens=False`` (``tokenizer.apply_chat_template`` does that itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set loop_messages = messages -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{ part['text'] | trim }}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "<bos>",
) -> str:
    """Render ``messages`` ({"role", "content"} dicts) with :data:`GEMMA_CHAT_TEMPLATE`."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(GEMMA_CHAT_TEMPLATE)
    return template.render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos_token
    )
