"""The reference miner: a signed, slot-limited OpenAI chat-completions endpoint in front of one runtime.

Validators call ``POST /v1/chat/completions`` signed with their hotkey (``bt.http_auth``, btauth/1,
receiver = this miner's hotkey). The miner checks, in order: body size (413), signature, freshness,
replay (401) and receiver (403), that the caller is trusted (403: validator-permit hotkeys from the
metagraph, or an allow-list locally), the JSON (400), then claims one of a fixed number of slots or
answers 429 at once: a miner that queues would hide its load from the validator's router and get
its TTFT measured worse. Slots are freed on completion, error and client disconnect.

Example::

    runner, port = await start_miner(dev_keypair("Bob"), SimulatedRuntime(PROFILES["rtx5090"]),
                                     slots=4, trust=AllowList({validator_ss58}))
    ...                                 # POST http://127.0.0.1:{port}/v1/chat/completions, signed
    await runner.cleanup()

    python -m neurons.miner --wallet.name miner --wallet.hotkey default --netuid 7 --network test \\
        --axon.ip 0.0.0.0 --axon.port 8091 --runtime.url http://127.0.0.1:8001 --slots 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
from collections.abc import Iterable
from typing import Any, Protocol

import aiohttp
import bittensor as bt
from aiohttp import web
from loguru import logger

from .chain.base import NeuronInfo
from .sim_runtime import Runtime, RuntimeFailure, SimulatedRuntime, parse_profile

CHAT_PATH = "/v1/chat/completions"
DEFAULT_MAX_BODY = 1024 * 1024


class Trust(Protocol):
    """Who may use this miner's slots."""

    def allows(self, hotkey: str) -> bool: ...


class AllowList:
    """A fixed set of trusted hotkeys: the local subnet, or an operator pinning its validators."""

    def __init__(self, hotkeys: Iterable[str]) -> None:
        self.hotkeys = frozenset(hotkeys)

    def allows(self, hotkey: str) -> bool:
        return hotkey in self.hotkeys


class _Metagraph(Protocol):
    async def metagraph(self) -> list[NeuronInfo]: ...


class PermitTrust:
    """Validator-permit hotkeys of the subnet, refreshed from the metagraph.

    A failed refresh keeps the last good set: a chain hiccup must not lock every validator out.
    """

    def __init__(self, chain: _Metagraph, *, refresh_s: float = 300.0, min_stake: float = 0.0) -> None:
        self._chain = chain
        self.refresh_s = refresh_s
        self.min_stake = min_stake
        self.hotkeys: frozenset[str] = frozenset()
        self.refreshed = False

    def allows(self, hotkey: str) -> bool:
        return hotkey in self.hotkeys

    async def refresh(self) -> bool:
        try:
            neurons = await self._chain.metagraph()
        except Exception as e:  # any chain failure keeps the last set
            logger.warning("metagraph refresh failed, keeping {} trusted hotkeys: {}", len(self.hotkeys), e)
            return False
        self.hotkeys = frozenset(n.hotkey for n in neurons if n.validator_permit and n.stake >= self.min_stake)
        self.refreshed = True
        logger.debug("trusting {} validator-permit hotkeys", len(self.hotkeys))
        return True

    async def run(self) -> None:
        """Refresh forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()


def error_response(status: int, message: str, *, type: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error shape, so any client (and the gateway) parses refusals the same way."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


def _sse_error(message: str, type: str, code: str | None) -> bytes:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class MinerServer:
    """The HTTP side of one miner; ``runtime`` does the inference, ``trust`` says who may call."""

    def __init__(self, keypair: Any, runtime: Runtime, slots: int, trust: Trust, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY, nonce_store: bt.http_auth.NonceStore | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.hotkey: str = keypair.ss58_address
        self.runtime = runtime
        self.slots = slots
        self.trust = trust
        self.max_body_bytes = max_body_bytes
        self._nonces = nonce_store if nonce_store is not None else bt.http_auth.InMemoryNonceStore(retention=60.0)
        self.busy = 0
        self.served = 0
        self.refused_busy = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app[MINER_KEY] = self
        app.router.add_post(CHAT_PATH, self._chat)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "slots": self.slots, "busy": self.busy,
                                  "runtime": self.runtime.name})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return self._too_large()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        try:
            caller = bt.http_auth.verify(request.headers, raw, method=request.method, path=request.path_qs,
                                         self_hotkey_ss58=self.hotkey, nonce_store=self._nonces)
        except bt.http_auth.WrongReceiver as e:
            return error_response(403, str(e), type="permission_error", code="wrong_receiver")
        except bt.http_auth.AuthError as e:
            return error_response(401, str(e), type="authentication_error", code=type(e).__name__)
        if not self.trust.allows(caller.hotkey_ss58):
            return error_response(403, "caller hotkey is not a trusted validator", type="permission_error",
                                  code="untrusted_caller")
        try:
            payload = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            return error_response(400, "request body is not valid JSON", type="invalid_request_error",
                                  code="invalid_json")
        problem = _check_payload(payload)
        if problem is not None:
            return error_response(400, problem[1], type="invalid_request_error", code="invalid_value", param=problem[0])
        # Admission: check and claim with no await in between, so it is atomic on the event loop.
        if self.busy >= self.slots:
            self.refused_busy += 1
            return error_response(429, f"all {self.slots} slots are busy", type="busy", code="busy",
                                  headers={"Retry-After": "0", "X-Miner-Slots": str(self.slots)})
        self.busy += 1
        try:
            return await self._serve(request, payload, caller.hotkey_ss58)
        finally:
            self.busy -= 1

    def _too_large(self) -> web.Response:
        return error_response(413, f"request body exceeds {self.max_body_bytes} bytes", type="invalid_request_error",
                              code="payload_too_large")

    async def _serve(self, request: web.Request, payload: dict[str, Any], caller: str) -> web.StreamResponse:
        async with contextlib.aclosing(self.runtime.stream(payload)) as frames:
            try:
                first = await anext(frames)
            except RuntimeFailure as e:
                return error_response(e.status, e.message, type=e.type, code=e.code, headers=e.headers or None)
            except StopAsyncIteration:
                return error_response(502, "runtime returned an empty stream", type="upstream_error",
                                      code="runtime_empty")
            except Exception:
                logger.exception("runtime failed before the first byte")
                return error_response(500, "runtime error", type="server_error", code="runtime_error")
            resp = web.StreamResponse(status=200, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Miner-Slots": str(self.slots)})
            try:
                await resp.prepare(request)
                await resp.write(first)
                try:
                    async for chunk in frames:
                        await resp.write(chunk)
                except RuntimeFailure as e:
                    logger.warning("runtime failed mid-stream for {}: {}", caller[:10], e.message)
                    await resp.write(_sse_error(e.message, e.type, e.code))
                    return resp
                except ConnectionError:
                    raise
                except Exception:
                    logger.exception("runtime failed mid-stream")
                    await resp.write(_sse_error("runtime error", "server_error", "runtime_error"))
                    return resp
                await resp.write_eof()
            except ConnectionError:
                logger.debug("caller {} disconnected mid-stream", caller[:10])
                return resp
            self.served += 1
            return resp


MINER_KEY = web.AppKey("miner", MinerServer)  # runner.app[MINER_KEY] is the server (busy, served, ...)


def _check_payload(payload: Any) -> tuple[str | None, str] | None:
    """The few things a runtime cannot do without; everything else is the runtime's to judge."""
    if not isinstance(payload, dict):
        return None, "request body must be a JSON object"
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages", "messages must be a non-empty list"
    if payload.get("stream") is not True:
        return "stream", "this miner only serves streamed completions (stream: true)"
    return None


async def start_miner(keypair: Any, runtime: Runtime, *, slots: int = 4, trust: Trust, host: str = "127.0.0.1",
                      port: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY) -> tuple[web.AppRunner, int]:
    """Serve a miner on ``host:port`` (port 0 picks a free one); returns the runner and the bound port.

    ``handler_cancellation`` makes a client disconnect cancel the handler at once, so a slot is freed
    even while the runtime is still before its first token.
    """
    server = MinerServer(keypair, runtime, slots, trust, max_body_bytes=max_body_bytes)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


# ---- CLI ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m neurons.miner",
                                description="tensorgate reference miner: signed, slot-limited chat completions")
    p.add_argument("--netuid", type=int, default=1, help="subnet to serve (network mode)")
    p.add_argument("--network", default="finney", help="finney | test | local | ws://host:port")
    p.add_argument("--wallet.name", dest="wallet_name", default="default", help="wallet (coldkey) name")
    p.add_argument("--wallet.hotkey", dest="wallet_hotkey", default="default", help="hotkey name in the wallet")
    p.add_argument("--wallet.path", dest="wallet_path", default=None, help="default ~/.bittensor/wallets")
    p.add_argument("--dev-key", dest="dev_key", default=None, metavar="NAME",
                   help="use the development key //NAME instead of a wallet (local testing only)")
    p.add_argument("--axon.ip", dest="axon_ip", default="127.0.0.1", help="address to bind")
    p.add_argument("--axon.port", dest="axon_port", type=int, default=8091, help="port to bind (0: any free port)")
    p.add_argument("--slots", type=int, default=4, help="concurrent requests served; more are refused with 429")
    p.add_argument("--runtime.url", dest="runtime_url", default=None,
                   help="OpenAI-compatible runtime to relay to (vLLM, SGLang, llama-server), e.g. http://127.0.0.1:8001")
    p.add_argument("--runtime.model", dest="runtime_model", default=None,
                   help="model name to put in requests to the runtime (default: keep the caller's)")
    p.add_argument("--runtime.sim", dest="runtime_sim", default="rtx5090",
                   help="simulated card when no --runtime.url: NAME or NAME:key=value,... (e.g. rtx5090-slow)")
    p.add_argument("--runtime.seed", dest="runtime_seed", type=int, default=None, help="seed of the simulated card")
    p.add_argument("--allow", action="append", default=[], metavar="HOTKEY",
                   help="trust this validator hotkey (repeatable); without it, trust the metagraph's permit holders")
    p.add_argument("--trust.refresh", dest="trust_refresh", type=float, default=300.0,
                   help="seconds between metagraph refreshes of the trusted validators")
    p.add_argument("--max-body", dest="max_body", type=int, default=DEFAULT_MAX_BODY, help="request body cap (bytes)")
    p.add_argument("--log-level", dest="log_level", default="INFO")
    args = p.parse_args(argv)
    if args.slots < 1:
        p.error("--slots must be >= 1")
    if args.runtime_url is None:
        try:
            parse_profile(args.runtime_sim)
        except ValueError as e:
            p.error(str(e))
    return args


async def _run(args: argparse.Namespace) -> int:
    from .keys import MissingKeyError, dev_keypair, load_hotkey

    try:
        keypair = dev_keypair(args.dev_key) if args.dev_key else load_hotkey(
            args.wallet_name, args.wallet_hotkey, args.wallet_path)
    except MissingKeyError as e:
        logger.error("{}", e)
        return 2
    async with contextlib.AsyncExitStack() as stack:
        runtime: Runtime
        if args.runtime_url:
            from .runtime_proxy import ProxyRuntime

            session = await stack.enter_async_context(aiohttp.ClientSession())
            runtime = ProxyRuntime(args.runtime_url, session, model=args.runtime_model)
        else:
            rng = random.Random(args.runtime_seed) if args.runtime_seed is not None else None
            runtime = SimulatedRuntime(parse_profile(args.runtime_sim), rng=rng)
        trust: Trust
        if args.allow:
            trust = AllowList(args.allow)
        else:
            from .chain.subtensor import SubtensorChain

            try:
                chain = await SubtensorChain.connect(args.network, args.netuid, keypair)
            except Exception as e:
                logger.error("cannot reach netuid {} on {}: {} (or pass --allow HOTKEY for local mode)",
                             args.netuid, args.network, e)
                return 1
            stack.push_async_callback(chain.close)
            permit = PermitTrust(chain, refresh_s=args.trust_refresh)
            await permit.refresh()
            refresher = asyncio.create_task(permit.run())
            stack.callback(refresher.cancel)
            trust = permit
        runner, port = await start_miner(keypair, runtime, slots=args.slots, trust=trust, host=args.axon_ip,
                                         port=args.axon_port, max_body_bytes=args.max_body)
        stack.push_async_callback(runner.cleanup)
        logger.info("miner {} listening on {}:{} ({} slots, runtime {}, trust {})", keypair.ss58_address,
                    args.axon_ip, port, args.slots, runtime.name,
                    "allow-list" if args.allow else f"permit holders of netuid {args.netuid} on {args.network}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("stopping")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper(),
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
