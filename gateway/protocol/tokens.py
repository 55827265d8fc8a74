"""The one prompt-size estimate, shared by the gateway (credit's expected prefill) and the simulated card.

Both sides must count alike: if the simulated card prefilled a different number of tokens than the
validator expects it to, an honest card would look slow or fast by the difference: ~4 characters a token
plus 4 per message for the chat template's role markers.

API keys' token limits are a different matter: there the estimate undercounts what a client really spends
(digits 3.98x, emoji 3.94x, CJK 1.77x against Gemma's tokenizer), so the gateway counts a limited key's
prompt with a :class:`PromptCounter` (the subnet model's own tokenizer, :mod:`neurons.model.tokenizer`)
wherever the validator has one, and falls back to this estimate only without one.

Example::

    estimate_prompt_tokens([{"role": "user", "content": "hello there"}])   # 3 + 4 = 7
"""

from __future__ import annotations

from typing import Any, Protocol

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # role markers the chat template wraps around each message


def message_text(message: Any) -> str:
    """A message's text: its string content, or its text parts joined; anything else counts as empty."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def estimate_prompt_tokens(messages: Any) -> int:
    """Estimated prompt tokens of a chat ``messages`` list (lenient: a miner must not refuse odd input)."""
    if not isinstance(messages, list):
        return 0
    return sum((len(message_text(m)) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE
               for m in messages)


class PromptCounter(Protocol):
    """A prompt's real token count (the model's tokenizer), for the limits of API keys."""

    name: str

    async def start(self) -> None: ...

    async def count(self, messages: list[dict[str, Any]]) -> int: ...

    async def aclose(self) -> None: ...
