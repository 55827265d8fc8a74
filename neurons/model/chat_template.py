"""The chat template of the subnet's model, shipped with the project because the packaged GGUF has none.

Without a template llama.cpp falls back to ChatML, and Gemma echoes the tags it never saw in
training. This is Gemma 3's own turn format (contents trimmed): a system message is folded into the first user turn,
``assistant`` is the ``model`` role, and the prompt ends by opening the model's turn. The miner's
runtime and the validator's reference render every prompt here, so an audit forces exactly the
tokens the miner conditioned on.

Example::

    render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    # '<start_of_turn>user\\nBe brief.\\n\\nHi<end_of_turn>\\n<start_of_turn>model\\n'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

START = "<start_of_turn>"
END = "<end_of_turn>"
END_OF_TURN = END  # the token that ends the model's turn: a stop the model chose
_ROLE = {"user": "user", "assistant": "model", "tool": "user"}


def _text(content: Any) -> str:
    """A message's text: a string, or the concatenated text parts (the gateway admits no other parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def render(messages: list[dict[str, Any]]) -> str:
    """The prompt text (special tokens spelled out) for ``messages``, ending in an open model turn."""
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for m in messages:
        role = m.get("role")
        text = _text(m.get("content"))
        if role in ("system", "developer"):
            if turns:  # a late system message: Gemma has no such role, it becomes a user turn
                turns.append(("user", text))
            else:
                system.append(text)
            continue
        turns.append((_ROLE.get(str(role), "user"), text))
    if system:
        preamble = "\n\n".join(system)
        if turns and turns[0][0] == "user":
            turns[0] = ("user", f"{preamble}\n\n{turns[0][1]}")
        else:
            turns.insert(0, ("user", preamble))
    out = [f"{START}{role}\n{text.strip()}{END}\n" for role, text in turns]
    out.append(f"{START}model\n")
    return "".join(out)


def jinja_template() -> str:
    """The same template in Jinja, for runtimes that render one (vLLM's ``--chat-template``, a Hugging Face
    folder's ``chat_template``): shipped beside this file, tested equal to :func:`render` byte for byte."""
    return (Path(__file__).with_name("chat_template.jinja")).read_text(encoding="utf-8")
