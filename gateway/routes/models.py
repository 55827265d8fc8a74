"""``GET /v1/models`` and ``GET /v1/models/{id}``: the configured models some routable miner serves now."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..asgi import Receive, Scope, Send, send_json
from ..protocol.errors import model_not_found

if TYPE_CHECKING:
    from ..app import Gateway

MODEL_PATH = "/v1/models/"


def served_models(gw: Gateway) -> list[str]:
    """The configured models some routable miner serves now (all of them while no miner is routable: nothing is
    known yet, and a request then gets the relay's own 429/503, not a 404)."""
    if not gw.router.routable():
        return list(gw.config.models)
    offered = gw.router.offered()
    return [m for m in gw.config.models if m in offered]


def model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "tensorgate"}


async def models(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    gw.authorize(headers)
    await send_json(send, 200, {"object": "list", "data": [model_object(m) for m in served_models(gw)]})


async def model(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    """``GET /v1/models/{id}`` (OpenAI's ``models.retrieve``): the model, or 404 ``model_not_found``."""
    gw.authorize(headers)
    name = scope["path"][len(MODEL_PATH):]
    if name not in served_models(gw):
        raise model_not_found(name)
    await send_json(send, 200, model_object(name))
