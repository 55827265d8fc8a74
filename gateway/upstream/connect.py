"""Sign and POST a miner-bound body, and check the answer's head: every failure named, none of them a crash.

What is the miner's and what is not is decided here: a connect that fails on the validator's own limits (open
files, buffers, memory) is ``local_resources``, never the miner's; a pooled connection the miner had closed is
retried once, re-signed (a nonce is used once); a 429 is judged against the slots the miner declared at dispatch
(:func:`~gateway.upstream.refusals.refusal`); a 400 naming a client-fault code is the client's.
"""

from __future__ import annotations

import asyncio
import errno

import aiohttp

from gateway.protocol.measurement import FailureReason

from ..http.client import MinerClient
from ..protocol.openai import CHAT_PATH
from ..protocol.signing import RequestSigner
from ..router import MinerState
from .refusals import client_fault, refusal

MAX_ERROR_BODY = 64 * 1024  # what is read of a refusal's body so its connection can be reused
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)  # a pooled connection the miner had closed
# The validator's own limits (open files, buffers, memory): a connect failing with these is never the miner's.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class ConnectFailed(Exception):
    """No usable answer head: ``reason`` is what the dispatch is recorded as."""

    def __init__(self, reason: FailureReason, detail: str = "", status: int | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status


async def post_signed(client: MinerClient, signer: RequestSigner, miner: MinerState, body: bytes, *,
                      deadline_at: float, connect_s: float) -> aiohttp.ClientResponse:
    """POST ``body``, signed for ``miner``, and return once the head arrived, by ``deadline_at`` (loop time).

    A pooled connection the miner had closed is tried once more, re-signed. Raises :class:`ConnectFailed`.
    """
    loop = asyncio.get_running_loop()
    for attempt in (1, 2):
        headers = signer.sign(path=CHAT_PATH, body=body, receiver_ss58=miner.hotkey)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        connect_timeout = max(0.0, min(connect_s, deadline_at - loop.time()))
        try:
            async with asyncio.timeout_at(deadline_at):
                return await client.post(miner.endpoint, CHAT_PATH, body, headers, connect_timeout=connect_timeout)
        except TimeoutError:
            raise ConnectFailed(FailureReason.TIMEOUT, "no response headers before the first-token deadline") \
                from None
        except aiohttp.ClientConnectorError as e:
            if e.os_error.errno in _LOCAL_ERRNOS:  # our own limits, not the miner's
                raise ConnectFailed(FailureReason.LOCAL_RESOURCES, str(e.os_error)) from None
            raise ConnectFailed(FailureReason.CONNECT, type(e).__name__) from None
        except aiohttp.ClientResponseError as e:  # bytes that are not an HTTP response (or too large a head)
            raise ConnectFailed(FailureReason.GARBAGE, f"bad HTTP response: {e.message}") from None
        except _STALE as e:
            if attempt == 1:
                continue  # a pooled connection the miner (or its runtime's keep-alive timer) had closed
            raise ConnectFailed(FailureReason.CONNECT, type(e).__name__) from None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            if isinstance(e, OSError) and e.errno in _LOCAL_ERRNOS:
                raise ConnectFailed(FailureReason.LOCAL_RESOURCES, str(e)) from None
            raise ConnectFailed(FailureReason.CONNECT, type(e).__name__) from None
    raise AssertionError("unreachable")


async def check_head(resp: aiohttp.ClientResponse, *, within_s: float, in_flight: int, slots: int,
                     may_not_fit: bool = False) -> None:
    """Raise :class:`ConnectFailed` unless ``resp`` is a 200 event stream, uncompressed.

    A refusal's small body is read (within ``within_s``) so its connection can be reused. ``in_flight`` and
    ``slots`` are this validator's streams on the miner and its declared slots, both at dispatch. ``may_not_fit``:
    the gateway's own reading that the request may be too long for the model (:func:`.refusals.may_not_fit`);
    only then is a miner's "the client's fault" believed.
    """
    status = resp.status
    if status != 200:
        body = await settle(resp, within_s, content_ok=True)
        if status == 429:
            raise ConnectFailed(refusal(in_flight, slots), status=status)
        rejected = client_fault(status, body)
        if rejected is not None and may_not_fit:  # the request's fault (too long for the model): not the miner's
            raise ConnectFailed(FailureReason.CLIENT_REJECTED, rejected, status=status)
        detail = f"HTTP {status}" if rejected is None else f"HTTP {status} for a request that fits the model"
        raise ConnectFailed(FailureReason.HTTP_STATUS, detail, status=status)
    ctype = resp.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if ctype != "text/event-stream":
        raise ConnectFailed(FailureReason.GARBAGE, f"content type {ctype!r}", status=200)
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise ConnectFailed(FailureReason.GARBAGE, f"content encoding {encoding!r}", status=200)


async def settle(resp: aiohttp.ClientResponse, within_s: float, *, content_ok: bool) -> bytes:
    """Read what is left of an answer so its connection can be reused; returns what was read.

    Released when the answer ends within ``within_s`` with at most :data:`MAX_ERROR_BODY` left (and, unless
    ``content_ok``, nothing but whitespace: bytes after ``[DONE]`` are a miner breaking the protocol);
    otherwise the connection is closed.
    """
    rest = b""
    try:
        async with asyncio.timeout(max(0.0, within_s)):
            rest = await resp.content.read(MAX_ERROR_BODY)
        if resp.content.at_eof() and (content_ok or not rest.strip()):
            resp.release()
            return rest
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    resp.close()
    return rest
