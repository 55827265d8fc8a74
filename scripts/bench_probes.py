"""Can a miner tell the validator's probes from users' requests? A detector written against our own generator.

Issue 23 built one from nothing but the probe generator's public templates and an index of the
standard library's docstrings (its corpus): it flagged 99.1-99.3 % of probes and 0 % of organic
requests. This script is that attacker, with the project's code in hand:

* **templates**: every fixed string of :mod:`neurons.validator.prompts` (questions, system prompts,
  topics, the filler, the document framing, the assistant opener) found in a request;
* **corpus**: 8-word shingles of *every* docstring of the standard library (the generator reads a
  random subset; the attacker indexes all of it), three hits in one request flag it;
* **seen before**: the request's messages equal one this miner served earlier (a replay that lands
  on the miner that served the original).

Traffic: ``--miners`` miners; a stream of organic requests (routed uniformly at random) and probes
(each to a random miner), the validator's own :class:`~neurons.validator.prompts.PromptGenerator`
wired as :func:`neurons.validator.build.build_parts` wires it (stdlib corpus, shapes and replays of
the organic stream). Organic requests are not the generator's: they are built from the installed
packages' own descriptions (``*.dist-info/METADATA``), human-written text the generator never reads,
asked about in phrasings of this script's own. Printed: the share of probes and of organic requests
each rule flags, with replays on and off, side by side.

Target (issue 23): at most 60 % of probes flagged at no more than 5 % of organic requests flagged.

Example::

    python scripts/bench_probes.py                # 4,000 requests per run, 4 / 8 / 32 miners
    python scripts/bench_probes.py --smoke        # seconds
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.protocol.openai import SchemaLimits, parse_chat_request  # noqa: E402
from neurons.validator import prompts as gen  # noqa: E402
from neurons.validator.corpus import docstrings, stdlib_passages  # noqa: E402
from neurons.validator.replays import ReplaySample  # noqa: E402
from neurons.validator.shapes import ShapeSample  # noqa: E402

LIMITS = SchemaLimits(models=("m",))
SHINGLE = 8  # words per shingle
CORPUS_HITS = 3  # shingles of the stdlib in one request that flag it
TARGET_PROBES = 0.60
TARGET_ORGANIC = 0.05
_WORD = re.compile(r"\w+")


# -- the attacker -------------------------------------------------------------------------------------


def _template_marks() -> list[str]:
    """Fixed strings of the generator, as an attacker reads them off its source."""
    marks: list[str] = []
    for t in gen._ASKS + gen._ABOUT:
        marks += [p.strip() for p in re.split(r"\{[a-z]+\}", t) if len(p.strip()) >= 12]
    marks += list(gen._SYSTEMS) + [f"about {t}" for t in gen._TOPICS]
    marks += ["Here is a document:", "With that context:", "I have a question about",
              "Of course. What would you like to know?", gen._FILLER[:60]]
    return sorted(set(marks))


def _shingles(text: str) -> set[int]:
    words = _WORD.findall(text.lower())
    return {int.from_bytes(hashlib.blake2b(" ".join(words[i:i + SHINGLE]).encode(), digest_size=8).digest(), "big")
            for i in range(max(0, len(words) - SHINGLE + 1))}


def stdlib_index() -> set[int]:
    """Shingles of every docstring of the standard library (not a subset: the attacker takes all of it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    index: set[int] = set()
    for path in root.rglob("*.py"):
        for doc in docstrings(path):
            index |= _shingles(doc)
    return index


@dataclass
class Detector:
    """One miner's detector: what it flags, by rule, from what it has seen."""

    marks: list[str]
    index: set[int]
    seen: set[str] = field(default_factory=set)

    def rules(self, payload: dict[str, Any]) -> set[str]:
        text = "\n".join(str(m.get("content", "")) for m in payload.get("messages", []) if isinstance(m, dict))
        out: set[str] = set()
        if any(mark in text for mark in self.marks):
            out.add("templates")
        hits = 0
        for s in _shingles(text):
            if s in self.index:
                hits += 1
                if hits >= CORPUS_HITS:
                    out.add("corpus")
                    break
        key = hashlib.sha256(repr(payload.get("messages")).encode()).hexdigest()
        if key in self.seen:
            out.add("seen")
        self.seen.add(key)
        return out


# -- organic traffic that is not the generator's --------------------------------------------------------

_PHRASINGS = (
    "{p}\n\ncan you explain what this package is for? keep it short",
    "I'm evaluating a dependency. Here's its description:\n{p}\nWhat are the risks of adopting it?",
    "summarize for my team standup:\n\n{p}",
    "{p}",
    "Write a tweet announcing this release.\n---\n{p}",
    "what would you name a competitor to this? {first}",
    "Translate to Spanish please:\n{p}",
    "Is this library a good fit for a small startup? Context: {p}",
    "Draft release notes based on:\n{p}",
    "My manager sent me this, what does it mean?\n\n{p}",
)
_USER_SYSTEMS = ("You are a senior engineer. Be blunt.", "Reply in markdown.", "You help a small SaaS team.")


def package_texts(limit: int = 4000) -> list[str]:
    """Paragraphs of the installed distributions' own descriptions."""
    out: list[str] = []
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else ""
        text = body if isinstance(body, str) else ""
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if 80 <= len(para) <= 2000 and not para.startswith(("```", "..", "|", "[![")):
                out.append(para)
    random.Random(0).shuffle(out)
    return out[:limit]


def organic_request(rng: random.Random, texts: list[str]) -> dict[str, Any]:
    p = rng.choice(texts)
    first = p.split("\n", 1)[0]
    msgs = [{"role": "system", "content": rng.choice(_USER_SYSTEMS)}] if rng.random() < 0.3 else []
    if rng.random() < 0.2:
        msgs += [{"role": "user", "content": rng.choice(texts)[:300]}, {"role": "assistant", "content": "Noted."}]
    msgs.append({"role": "user", "content": rng.choice(_PHRASINGS).format(p=p, first=first)})
    body: dict[str, Any] = {"model": "m", "messages": msgs, "stream": True, "max_tokens": rng.choice((64, 200, 256,
                                                                                                       512, 1000))}
    if rng.random() < 0.6:
        body["temperature"] = rng.choice((0.2, 0.7, 1.0))
    return body


# -- one run ---------------------------------------------------------------------------------------------


@dataclass
class Counts:
    n: int = 0
    flagged: int = 0
    by_rule: dict[str, int] = field(default_factory=dict)

    def add(self, rules: set[str]) -> None:
        self.n += 1
        self.flagged += bool(rules)
        for r in rules:
            self.by_rule[r] = self.by_rule.get(r, 0) + 1

    def share(self, rule: str | None = None) -> float:
        k = self.flagged if rule is None else self.by_rule.get(rule, 0)
        return k / self.n if self.n else 0.0


def run(miners: int, requests: int, probe_share: float, replay: bool, seed: int, marks: list[str],
        index: set[int], texts: list[str], corpus: list[str]) -> tuple[Counts, Counts]:
    rng = random.Random(seed)
    shapes = ShapeSample(rng=random.Random(seed + 1))
    replays = ReplaySample(rng=random.Random(seed + 2)) if replay else None
    prompts = gen.PromptGenerator(random.Random(seed + 3), gen.MIXES["gpu"], corpus=corpus, shapes=shapes,
                                  replays=replays)
    detectors = [Detector(marks, index) for _ in range(miners)]
    probes, organic = Counts(), Counts()
    for _ in range(requests):
        target = detectors[rng.randrange(miners)]
        if rng.random() < probe_share:
            probes.add(target.rules(prompts.payload("m")))
        else:
            body = organic_request(rng, texts)
            req = parse_chat_request(body, LIMITS)
            shapes.observe(req)  # what the gateway's on_request does in build_parts
            if replays is not None:
                replays.observe(req)
            organic.add(target.rules(body))
    return probes, organic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="requests per run (probes and organic)")
    ap.add_argument("--probe-share", type=float, default=0.2, help="share of the requests that are probes")
    ap.add_argument("--miners", type=int, action="append", default=None, help="miners (repeatable; 4, 8, 32)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="a few hundred requests, 8 miners: seconds")
    args = ap.parse_args(argv)
    miners = args.miners or ([8] if args.smoke else [4, 8, 32])
    requests = 400 if args.smoke else args.requests
    t0 = time.monotonic()
    marks = _template_marks()
    texts = package_texts()
    corpus = stdlib_passages(random.Random(args.seed))
    # --smoke indexes only the passages the generator drew (the probes' hits are the same; indexing all of the
    # standard library takes ~90 s here)
    index = set().union(*map(_shingles, corpus)) if args.smoke else stdlib_index()
    print(f"detector: {len(marks)} template strings, {len(index):,} stdlib shingles; organic from {len(texts)} "
          f"package-description paragraphs; probe corpus {len(corpus)} passages")
    head = (f"{'replays':<8} {'miners':>6} {'probes':>6} {'flagged':>8} {'templ':>6} {'corpus':>6} {'seen':>6}   "
            f"{'organic':>7} {'flagged':>8}")
    print(head)
    print("-" * len(head))
    verdicts: list[str] = []
    ok = True
    for n in miners:
        for replay in (False, True):
            p, o = run(n, requests, args.probe_share, replay, args.seed, marks, index, texts, corpus)
            print(f"{'on' if replay else 'off':<8} {n:>6} {p.n:>6} {p.share():8.1%} {p.share('templates'):6.1%} "
                  f"{p.share('corpus'):6.1%} {p.share('seen'):6.1%}   {o.n:>7} {o.share():8.1%}")
            if replay:
                passed = p.share() <= TARGET_PROBES and o.share() <= TARGET_ORGANIC
                ok = ok and passed
                verdicts.append(f"{'PASS' if passed else 'FAIL'}  {n} miners, replays on: {p.share():.1%} of probes "
                                f"flagged (target <= {TARGET_PROBES:.0%}) at {o.share():.1%} of organic (target <= "
                                f"{TARGET_ORGANIC:.0%})")
    print()
    print("\n".join(verdicts))
    print(f"done in {time.monotonic() - t0:.1f} s")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
