"""What the gateway adds to the head of an answer it relays: the key's rate-limit standing and a served-at-the-cap
note. One wrapper around the ASGI ``send``, so the relay and the upstream code never see either."""

from __future__ import annotations

from .asgi import Message, Send
from .protocol.openai import ChatRequest


def answer_headers(send: Send, req: ChatRequest, limits: dict[str, str]) -> Send:
    """``send`` that adds to the answer's head the key's ``x-ratelimit-*`` headers (``limits``) and
    ``X-Max-Tokens-Capped: <cap>`` when the client asked for more tokens than the gateway serves
    (``GatewayConfig.max_tokens_cap``): served at the cap, and said so, not silently."""
    extra = [(k.encode("ascii"), v.encode("ascii")) for k, v in limits.items()]
    if req.max_tokens_asked is not None:
        extra.append((b"x-max-tokens-capped", str(req.max_tokens).encode("ascii")))
    if not extra:
        return send

    async def adding(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)
    return adding
