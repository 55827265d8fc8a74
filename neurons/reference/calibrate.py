"""``python -m neurons.reference.calibrate``: measure the honest spread between this reference and a miner, write bands.

The miner is asked what a validator asks: signed requests from the probes' prompt mix, each with the subnet
sampler's seed (or none, ``--free-sampling``). It must trust the calibrating key (``--allow`` on the reference
miner). Its answers are replayed on the reference (``--model``, the file the validator audits with), each
position's gap from the reference's choice is kept, and the bands file :mod:`neurons.reference.bands` derives
from them is written (``--out``). Run it against a miner you know is honest: the file says what honest looks like.

Example::

    python -m neurons.reference.calibrate --miner http://gpu-box:8091 --model /models/subnet.gguf \\
        --dev-key Alice --answers 300 --out bands.json
    python -m neurons.validator ... --audit.model /models/subnet.gguf --audit.bands bands.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from loguru import logger

from gateway.http.client import MinerClient
from gateway.protocol.measurement import Answer, Measurement
from gateway.protocol.signing import RequestSigner
from gateway.router import Candidate, Router
from gateway.upstream import Upstream, UpstreamLimits
from scoring.audit import AuditBands, Verdict

from ..keys import dev_keypair, load_hotkey
from ..logs import to_stderr
from ..model.engine import EngineThread, LlamaEngine
from ..model.packaged import ModelUnavailable, model_path
from .bands import MAX_HONEST_MISS_RATE, HonestSpread, bands_from, describe, over_ceiling, save_bands
from .llama import replay_scored


def spread_of(engine: LlamaEngine, answer: Answer, bands: AuditBands
              ) -> tuple[list[float], list[float], Verdict] | None:
    """On the reference's thread: each determined position's gap, the probability mass by which each token beyond
    its asked nucleus lay beyond it, and the verdict (None: too long to replay)."""
    scored = replay_scored(engine, answer, bands)
    if scored is None:
        return None
    verdict, scores = scored
    if scores is None or not (answer.sampling.greedy or answer.sampling.seeded):
        return [], [], verdict
    return [float(g) for g in scores.gap], [float(e) for e in scores.nucleus_excess if e > 0], verdict


def _model_file(name: str) -> Path:
    return model_path() if name == "packaged" else Path(name).expanduser()


class _Collect:
    """The measurement sink: keeps what each probe measured."""

    def __init__(self) -> None:
        self.items: list[Measurement] = []

    def record(self, m: Measurement) -> None:
        self.items.append(m)


async def _miner_identity(session: aiohttp.ClientSession, url: str) -> tuple[str, str | None]:
    """The miner's hotkey and the sampler it declares (its ``/health``, as a validator reads with its offer): without
    the sampler its first sampled answer would be sent no seed, and judged as a free draw."""
    async with session.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
        body = await r.json(content_type=None)
    hotkey = body.get("hotkey") if isinstance(body, dict) else None
    if not isinstance(hotkey, str) or not hotkey:
        raise RuntimeError(f"{url}/health names no hotkey (is it a tensorgate miner?)")
    sampler = body.get("sampler")
    return hotkey, sampler if isinstance(sampler, str) else None


@dataclass
class _Tally:
    """The honest spread of the answers replayed so far, and how many could not be."""

    gaps: list[float] = field(default_factory=list)
    zs: list[float] = field(default_factory=list)
    excess: list[float] = field(default_factory=list)
    misses: int = 0
    positions: int = 0
    failed: int = 0
    skipped: int = 0
    free: int = 0

    def add(self, got: tuple[list[float], list[float], Verdict] | None) -> None:
        """One answer's replay (:func:`spread_of`): its gaps, its excess over the nucleus and its verdict; None: the
        answer could not be replayed."""
        if got is None:
            self.skipped += 1
            return
        gaps, excess, verdict = got
        self.gaps += gaps
        self.excess += excess
        self.misses += verdict.misses
        self.positions += verdict.positions
        self.failed += not verdict.passed
        if verdict.z is not None:
            self.zs.append(abs(verdict.z))
            self.free += 1

    def figures(self, answers: int) -> dict[str, Any]:
        return {"replayed": answers - self.skipped, "positions": self.positions, "misses_at_default_band": self.misses,
                "failed_at_default_bands": self.failed, "worst_nucleus_excess": max(self.excess, default=0.0),
                "worst_gap": max(self.gaps, default=0.0), "max_abs_z": max(self.zs, default=0.0),
                "free_draws": self.free}


async def calibrate(args: argparse.Namespace, keypair: Any) -> int:
    from ..validator.prompts import MIXES, PromptGenerator, asking_nucleus

    url = args.miner if "://" in args.miner else f"http://{args.miner}"
    async with aiohttp.ClientSession() as session:
        hotkey, sampler = await _miner_identity(session, url)
    router = Router()
    router.sync([Candidate(uid=1, hotkey=hotkey, endpoint=url.split("://", 1)[1].rstrip("/"), slots=1)])
    for miner in router.miners():
        Upstream.learn_sampler(miner, sampler)
    sink = _Collect()
    upstream = Upstream(MinerClient(), RequestSigner(keypair), sink,
                        limits=UpstreamLimits(keep_answers=True, seeded_sampling=not args.free_sampling))
    ref = EngineThread("calibrate")
    path = await asyncio.to_thread(_model_file, args.model)
    await ref.load(path, n_ctx=args.context, threads=args.threads)
    base = AuditBands()
    prompts = PromptGenerator(random.Random(args.seed), MIXES[args.mix])
    tally = _Tally()
    t0 = time.monotonic()
    try:
        for i in range(args.answers):
            lease = router.acquire()
            if lease is None:
                raise RuntimeError("the miner is not routable")
            try:
                payload = prompts.payload(args.served_model)
                m = await upstream.probe(lease, payload if args.top_p is None else asking_nucleus(payload, args.top_p))
            finally:
                router.release(lease)
            tally.add(None if not m.ok or m.answer is None else await ref.run(spread_of, m.answer, base))
            if (i + 1) % 50 == 0:
                logger.info("{} of {} answers replayed", i + 1, args.answers)
    finally:
        await upstream.client.close()
        await ref.aclose()
    t = tally
    if not t.positions and not t.zs:
        logger.error("no answer could be replayed ({} skipped): nothing to calibrate from", t.skipped)
        return 1
    spread = HonestSpread(gaps=t.gaps, misses=t.misses, positions=t.positions, z=t.zs, nucleus_excess=t.excess)
    outside = sum(e >= base.seeded_nucleus_slack for e in t.excess)
    bands, test = bands_from(spread)
    refusal = _refusal(t.misses, t.positions, over_ceiling(bands, test))
    if refusal:
        logger.error("{}; no bands written", refusal)
        return 2
    measured = {"miner": url, "miner_hotkey": hotkey, "reference": str(path), "answers": args.answers,
                **t.figures(args.answers), "outside_nucleus_at_default_slack": outside,
                "seconds": round(time.monotonic() - t0, 1), "free_sampling": bool(args.free_sampling),
                "top_p": args.top_p}
    save_bands(Path(args.out), bands, test, measured=measured)
    logger.info("honest spread: {} positions, {} off the default near-tie band ({} outside the nucleus), worst gap "
                "{:.2f}; {} answers of {} failed the default bands", t.positions, t.misses, outside,
                max(t.gaps, default=0.0), t.failed, args.answers - t.skipped)
    logger.info("wrote {}: {}", args.out, describe(bands, test))
    return 0


def _refusal(misses: int, positions: int, over: list[str]) -> str | None:
    """Why this miner's answers are no honest spread to widen the bands by (None: they are)."""
    if positions and misses / positions > MAX_HONEST_MISS_RATE:
        return (f"the miner's greedy and seeded answers missed {misses} of {positions} positions "
                f"({misses / positions:.1%}; honest runtimes miss under {MAX_HONEST_MISS_RATE:.0%}): it does not run "
                "the sampler it declares, or serves another model")
    if over:
        return f"the bands this miner needs are over the ceiling ({', '.join(over)})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neurons.reference.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--miner", required=True, help="a miner known to be honest: http://host:port")
    p.add_argument("--model", default="packaged", help="the reference's GGUF file (what --audit.model names)")
    p.add_argument("--out", required=True, help="the bands file to write (--audit.bands reads it)")
    p.add_argument("--answers", type=int, default=300, help="answers to ask for and replay")
    p.add_argument("--served-model", dest="served_model", default="tensorgate/gemma-3-270m",
                   help="the model name put in the requests")
    p.add_argument("--mix", choices=("cpu", "gpu"), default="cpu", help="prompt sizes (neurons.validator.prompts)")
    p.add_argument("--free-sampling", action="store_true", help="no sampler seed (as --gateway.free-sampling)")
    p.add_argument("--top-p", dest="top_p", type=float, default=None,
                   help="ask every sampled request for this nucleus (0 < P <= 1): the mix asks for one only now and "
                        "then, and the nucleus slack is measured where one is asked")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dev-key", dest="dev_key", default=None, help="sign with //NAME (local testing)")
    p.add_argument("--wallet.name", dest="wallet_name", default=None)
    p.add_argument("--wallet.hotkey", dest="wallet_hotkey", default="default")
    p.add_argument("--wallet.path", dest="wallet_path", default=None)
    args = p.parse_args(argv)
    if args.answers < 1:
        p.error("--answers must be >= 1")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        p.error(f"--top-p must be within (0, 1], got {args.top_p}")
    if not args.dev_key and not args.wallet_name:
        p.error("sign with a validator's hotkey: --wallet.name (and --wallet.hotkey), or --dev-key NAME locally")
    to_stderr("info")
    keypair = dev_keypair(args.dev_key) if args.dev_key else load_hotkey(args.wallet_name, args.wallet_hotkey,
                                                                           args.wallet_path)
    try:
        return asyncio.run(calibrate(args, keypair))
    except (ModelUnavailable, RuntimeError, aiohttp.ClientError, OSError) as e:
        logger.error("{}", e)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
