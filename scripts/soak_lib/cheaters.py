"""Dishonest miners for the adversarial soak: real (simulated) cards, served with lies on top.

Each cheat of issue 14's exploit table is built the strongest way the project could think of: the
probe-recognising miners are told *perfectly* which requests are the validator's probes (the
harness hands them an oracle, where a real cheater would guess from prompt templates and parameter
menus), so the scenario tests the pay rules, not how well probes are disguised.

* ``refuse-when-card-busy``: answer 429 (declaring its slots free) whenever its card already has a
  stream; on a card shared by several hotkeys that is "another hotkey of mine is using the card".
* ``probes-only``: serve the validator's probes, refuse every user request with a 429.
* ``probes-stall``: serve probes, leave every user request hanging before its first byte.
* ``self-dealer``: its owner also holds an API key and sends long prompts marked with
  :data:`SELF_MARK` through the gateway; whichever of them is routed to its own miner is answered at
  once with the model's own answer, computed beforehand (no prefill, no decode, no card time now: it
  passes its audits), everything else honestly.

Issue 23's cheats, each given a perfect oracle too (of the capacity check's streams, or of probes):

* ``hold-check``: an honest card that computes each capacity-check stream's real answer, holds its first
  token and sends everything at once at the end (on a card whose rate was timed from its first token,
  that read as any speed it liked), and serves everything else honestly.
* ``hold-check-429``: the same on the check, and a 429 for anything else while its card is busy (four
  1-slot hotkeys on one card).
* ``slot-liar``: 429 whenever its card is busy, declaring ``X-Miner-Slots: 1`` on each 429 while its
  answers declare its real slots (the refusal used to be judged on the 429's own header).
* ``burst``: every answer computed, held and sent in one write (a half-speed card hiding its speed).
* ``cycler``: honest to probes, junk to users (another prompt's answer, at the card's speed): it
  fails the audits of the users' answers it is sampled on and cycles through quarantine.

Issue 38's:

* ``too-long-when-busy``: whenever its card already has a stream, a 400 ``context_length_exceeded`` (the client's
  fault, it says) instead of a 429: four 1-slot hotkeys on one card refused that way for free, at the capacity
  check too, and routed as unmeasured.

* ``check-second``: on a card shared with a sibling hotkey, start each capacity-check stream only once the card is
  idle: the sibling's check streams run alone and read as a whole card, this one's after them as a share, more
  than one card for one where serving both at once reads 0.5 + 0.5 (measured 1.0 + 0.11 cards, until a check
  stream whose first token came after the TTFT band's zero counted 0).

* ``stall-second``: the same with the first token on time: each capacity-check stream's first token at once, the
  rest only once the card is idle (then at the card's own pace), so the sibling's check streams run alone. Timed
  from the decode clock to each stream's end it read 1.5 cards for one (by arithmetic, issue 38's open hole); by
  the check's common deadline (:func:`scoring.rounds.rate_by_deadline`) the held streams deliver their first token.
  The held streams are not on the simulated card while they wait (a real runtime would not schedule them either).

* ``stall-but-one``: the same, but one of this hotkey's check streams at a time runs on the card beside the
  sibling's (the others stall after their first token, as ``stall-second``'s). The sibling then reads 3 streams of
  a card holding 4, as a card carrying other validators' load does, and this hotkey a sliver: measured 0.62-0.65 and
  0.17 (2026-12-07). With the one-card band from 0.65 or 0.7 the group weighed up to 1.11x an honest card; from
  0.75, 0.68-0.96x (:mod:`scoring.capacity`: the band's trade).

* ``stall-part``: ``stall-but-one`` tuned to the one-card band's flat top (a reading from 0.75 routes as a whole card):
  its one check stream leaves the card after :data:`ON_CARD_PART` of its tokens, so the sibling reads nearer a whole
  card and this hotkey keeps a share; if the two readings summed to one card, the sibling at 0.75 and this one at 0.25
  would route as 1.25 cards. They sum to about 0.8 (adversarial soak, seed 1, 2026-12-07): on the card for 15 % of
  its tokens it read 0.74 + 0.05, routed as 0.98 + 0.05 cards and the group weighed 0.93x an honest card; 30 %:
  0.70 + 0.10, 0.89 + 0.10, 0.95x; 60 %: 0.60 + 0.17, 0.70 + 0.17, 0.84x. The flat top is worth 0.03 of a card at
  best, and the group's weight stays under one card's.

Cheats that are a property of the card itself (two tokens then ``stop``, a half-speed card cutting
every token into id-less chunks) are :class:`~neurons.miner.runtimes.sim.CardProfile` knobs.

Example::

    rt = CheatRuntime(card, "probes-only", slots=4, is_probe=oracle)
    runner, port = await start_miner(key, rt, slots=4, trust=trust)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from gateway.protocol.openai import SLOTS_HEADER
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame
from neurons.miner.runtimes.base import RuntimeFailure, RuntimeHealth
from neurons.model.toy import MODEL as TOY

from .load import CardRuntime

CHEATS = ("refuse-when-card-busy", "probes-only", "probes-stall", "self-dealer", "hold-check", "hold-check-429",
          "slot-liar", "burst", "cycler", "too-long-when-busy", "check-second", "stall-second", "stall-but-one",
          "stall-part")
PROBE_MARK = "\u2063"  # an invisible separator before a probe's prompt: the oracle (ProbeOracle)
CHECK_MARK = PROBE_MARK * 2  # ... two before a capacity-check stream's
SELF_MARK = "[ref 7f3a]"  # the self-dealer's own prompts carry it (a real one would hide it better)
ON_CARD_PART = 0.3  # stall-part: the share of its one check stream's tokens decoded on the card (see the docstring)
HANG_S = 3600.0  # "until the client gives up": the validator's first-token deadline ends it long before


class CheatRuntime:
    """One hotkey's view of a (possibly shared) card, with a lie on top."""

    def __init__(self, card: CardRuntime, cheat: str, *, slots: int, is_probe: Callable[[dict[str, Any]], bool],
                 is_check: Callable[[dict[str, Any]], bool] = lambda _: False) -> None:
        if cheat not in CHEATS:
            raise ValueError(f"unknown cheat {cheat!r}; known: {', '.join(CHEATS)}")
        self.card = card
        self.cheat = cheat
        self.slots = slots
        self.is_probe = is_probe
        self.is_check = is_check
        self.name = f"cheat:{cheat}:{card.name}"
        self.features = card.features
        self.sampler = card.sampler  # a cheat declares the subnet's sampler: its answers are paid if they pass
        self.refused = 0
        self._stalled = 0  # stall-second: check streams holding their decode until the card is idle
        self._checking = 0  # stall-but-one: check streams running on the card now

    @property
    def active(self) -> int:
        return self.card.active

    @property
    def runtime_ttfts(self) -> list[float]:
        return self.card.runtime_ttfts

    def health(self) -> RuntimeHealth:
        return self.card.health()

    def set_profile(self, profile: Any) -> None:
        self.card.set_profile(profile)

    def _too_long(self) -> RuntimeFailure:
        self.refused += 1
        return RuntimeFailure("This model's maximum context length is 4096 tokens", status=400,
                              type="invalid_request_error", code="context_length_exceeded")

    def _refuse(self, declared: int | None = None) -> RuntimeFailure:
        self.refused += 1
        return RuntimeFailure("busy", status=429, type="busy", code="busy",
                              headers={"Retry-After": "0", SLOTS_HEADER: str(declared or self.slots)})

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        cheat = self.cheat
        if cheat == "self-dealer":
            if SELF_MARK in _key(payload):
                yield _instant_answer(payload)
                return
        elif cheat == "refuse-when-card-busy":
            if self.card.active > 0:
                raise self._refuse()
        elif cheat == "slot-liar":
            if self.card.active > 0:
                raise self._refuse(declared=1)
        elif cheat == "too-long-when-busy":
            if self.card.active > 0:
                raise self._too_long()
        elif cheat in ("hold-check", "hold-check-429", "burst"):
            if cheat == "burst" or self.is_check(payload):
                yield await self._held(payload)
                return
            if cheat == "hold-check-429" and self.card.active > 0:
                raise self._refuse()
        elif cheat == "check-second":
            if self.is_check(payload):
                await self._card_idle()
        elif cheat == "stall-second":
            if self.is_check(payload):
                async for part in self._stalled_answer(payload):
                    yield part
                return
        elif cheat in ("stall-but-one", "stall-part"):
            if self.is_check(payload):
                if self._checking:
                    async for part in self._stalled_answer(payload):
                        yield part
                    return
                self._checking += 1
                try:
                    served = self.card.stream(payload) if cheat == "stall-but-one" else self._part_on_card(payload)
                    async with contextlib.aclosing(served) as frames:
                        async for chunk in frames:
                            yield chunk
                finally:
                    self._checking -= 1
                return
        elif cheat == "cycler":
            if not self.is_probe(payload):  # junk for users: another prompt's answer, at the card's own speed
                payload = {**payload, "messages": [{"role": "user", "content": "something else entirely"}]}
        elif not self.is_probe(payload):
            if cheat == "probes-only":
                raise self._refuse()
            await asyncio.sleep(HANG_S)
        async with contextlib.aclosing(self.card.stream(payload)) as frames:
            async for chunk in frames:
                yield chunk

    async def _card_idle(self) -> None:
        """Wait until nothing runs on the card (bounded: the validator's first-token deadline ends it sooner)."""
        step = 0.02 / self.card.scale
        for _ in range(int(HANG_S / step)):
            if self.card.active == 0:
                return
            await asyncio.sleep(step)

    async def _stalled_answer(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """The model's own answer (its seeded draw, which passes the audit): the first token at once, the rest once
        the card is idle, at the card's aggregate rate shared by the streams that waited."""
        f, ids, ended = _model_answer(payload, SamplingParams.of(payload), "chatcmpl-stall")
        await asyncio.sleep(0.1 / self.card.scale)  # a short prompt's prefill
        yield frame(f.chunk({"role": "assistant"}, None)) + f.tokens(TOY.piece(ids[0]).decode(), [ids[0]])
        async with contextlib.aclosing(self._rest_once_idle(f, ids[1:], ended)) as rest:
            async for part in rest:
                yield part

    async def _rest_once_idle(self, f: ChunkFramer, ids: list[int], ended: bool) -> AsyncGenerator[bytes, None]:
        """The rest of a held answer: ``ids`` once the card is idle, at its aggregate rate shared by the streams that
        waited, then the finish and ``[DONE]``."""
        self._stalled += 1
        try:
            await self._card_idle()
            per_token = self._stalled / self.card.profile.aggregate_tok_s / self.card.scale
            for t in ids:
                await asyncio.sleep(per_token)
                yield f.tokens(TOY.piece(t).decode(), [t])
        finally:
            self._stalled -= 1
        yield frame(f.chunk({}, "stop" if ended else "length")) + DONE_FRAME

    async def _part_on_card(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """``stall-part``'s check stream: on the card for the first :data:`ON_CARD_PART` of its tokens, then off it
        (the sibling's check streams get the whole card) and the rest once the card is idle, as a stalled one's."""
        f, ids, ended = _model_answer(payload, SamplingParams.of(payload), "chatcmpl-part")
        on_card = max(1, round(len(ids) * ON_CARD_PART))
        sent = -1  # the card's first frame names the role, each after it one token
        async with contextlib.aclosing(self.card.stream(payload)) as frames:
            async for chunk in frames:
                if sent >= on_card and b"[DONE]" not in chunk and sent < len(ids):
                    break  # leaves the card: the same answer goes on below, off it
                yield chunk
                sent += chunk.count(b"data: ")
            else:
                return  # the card ended it first
        async with contextlib.aclosing(self._rest_once_idle(f, ids[sent:], ended)) as rest:
            async for part in rest:
                yield part

    async def _held(self, payload: dict[str, Any]) -> bytes:
        """The card's real answer, computed in full and held: all of it in one write at the end."""
        parts: list[bytes] = []
        async with contextlib.aclosing(self.card.stream(payload)) as frames:
            async for chunk in frames:
                parts.append(chunk)
        return b"".join(parts)


def _model_answer(payload: dict[str, Any], sampling: SamplingParams, completion_id: str
                  ) -> tuple[ChunkFramer, list[int], bool]:
    """A framer for an answer the cheat writes itself, and the model's own tokens for ``payload`` (``max_tokens``,
    16 when it names none) drawn as ``sampling`` asks (a seeded draw is the one the audit replays)."""
    n = payload.get("max_tokens")
    n = n if isinstance(n, int) and n > 0 else 16
    ids, ended = TOY.generate(TOY.key(payload.get("messages")), n, sampling, random.Random(0))
    return ChunkFramer(completion_id, int(time.time()), str(payload.get("model", "m"))), ids, ended


def _instant_answer(payload: dict[str, Any]) -> bytes:
    """The model's greedy answer, all in one write (as if computed beforehand): ids, finish, ``[DONE]``."""
    f, ids, ended = _model_answer(payload, SamplingParams(temperature=0.0), "chatcmpl-self")
    finish = "stop" if ended else "length"
    parts = [frame(f.chunk({"role": "assistant"}, None))]
    parts += [f.tokens(TOY.piece(t).decode(), [t]) for t in ids]
    parts += [frame(f.chunk({}, finish)), DONE_FRAME]
    return b"".join(parts)


class ProbeOracle:
    """A perfect oracle of the validator's probes (and of which are capacity-check streams), with no channel between
    the validator and the cards (they may run in another process: :mod:`soak_lib.cards`): the probe runner marks the
    prompts it makes with an invisible character, and a cheater reads the mark in the request it receives."""

    @staticmethod
    def remember(payload: dict[str, Any], *, check: bool = False) -> None:
        messages = payload.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            last = messages[-1]
            last["content"] = (CHECK_MARK if check else PROBE_MARK) + str(last.get("content", ""))

    def __call__(self, payload: dict[str, Any]) -> bool:
        return _key(payload).startswith(PROBE_MARK)  # a check's mark starts with the probe's

    def is_check(self, payload: dict[str, Any]) -> bool:
        return _key(payload).startswith(CHECK_MARK)


def _key(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return ""
    return str(messages[-1].get("content"))
