"""Probe material that ships with every Python: the standard library's own documentation.

A short list of templates is learnt by a cheating miner in minutes (issue 14: 100 % of 20,000 probes
told apart). The standard library carries thousands of distinct, human-written passages (module,
class and function docstrings on every topic from e-mail parsing to calendars to compression), in
every environment the validator runs in, with nothing to download. :func:`stdlib_passages` reads a
random subset of them once at start (file I/O and parsing: call it off the event loop);
:class:`~neurons.validator.prompts.PromptGenerator` asks about them in many ways.

Example::

    passages = stdlib_passages(random.Random(0), files=300)    # ~3,000 passages in ~1 s
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_CHARS = 80  # shorter docstrings ("Return self.") say nothing worth asking about
MAX_CHARS = 3000


def docstrings(path: Path) -> Iterator[str]:
    """Every module, class and function docstring of one Python file (none for a file that does not parse)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def stdlib_passages(rng: random.Random, *, files: int = 300) -> list[str]:
    """Docstrings of ``files`` random standard-library modules (tests and private modules excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(p for p in root.rglob("*.py")
                        if not any(part.startswith(("test", "_", "idlelib", "site-packages")) for part in
                                   p.relative_to(root).parts))
    return [doc[:MAX_CHARS] for path in rng.sample(candidates, min(files, len(candidates)))
            for doc in docstrings(path) if len(doc) >= MIN_CHARS]
