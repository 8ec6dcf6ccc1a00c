"""Chat messages to one prompt: the tokenizer's own chat template, or, where it has none (the tiny model's),
this fallback, documented in docs/api.md: each message as `<|role|>` on a line of its own, then its text,
then a blank line; with add_generation_prompt, a closing `<|assistant|>` line for the answer."""

from __future__ import annotations

from engines.api.validation import InvalidRequest

FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> str:
    if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise InvalidRequest("continue_final_message needs a last assistant message and add_generation_prompt "
                             "false", "continue_final_message")
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    except (ValueError, TypeError, KeyError) as e:  # a template that refuses these messages (roles, order)
        raise InvalidRequest(f"messages do not fit the chat template: {e}"[:300], "messages") from None
