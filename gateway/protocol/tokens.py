"""The one prompt-size estimate, shared by the gateway (credit's expected prefill) and the simulated card.

Both sides must count alike: if the simulated card prefilled a different number of tokens than the
validator expects it to, an honest card would look slow or fast by the difference. A real tokenizer
would be better (it is planned for the reference runtime); until then, ~4 characters a token plus 4
per message for the chat template's role markers.

Example::

    estimate_prompt_tokens([{"role": "user", "content": "hello there"}])   # 3 + 4 = 7
"""

from __future__ import annotations

from typing import Any

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
