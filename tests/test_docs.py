"""The documentation a reader uses: the README is a landing page, ``docs/`` builds as a site, every link and code
block is valid, and the quick start's commands run.

Links: MkDocs checks those between pages (``--strict``); a link to one of the repository's files (a script, the
dashboard's image) leaves the site, so this file checks that the file exists, and that a ``#anchor`` names a
heading of its page. Code blocks: ``bash`` must parse (``bash -n``), ``python`` compile, ``toml`` load.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.fakes import start_local_job

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "pages").glob("*.md"))]
README_MAX_LINES = 250  # a landing page (issue 40); what a reader needs past it is in docs/
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _slug(heading: str) -> str:
    """MkDocs' (Python-Markdown's toc) anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text).strip("-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _quick_start() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Quick start")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    out: list[str] = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" # ", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


def test_readme_is_a_landing_page() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"
    for page in PAGES[1:]:
        assert f"docs/pages/{page.name}" in (REPO / "README.md").read_text() or page.name == "index.md", (
            f"the README's documentation table does not name docs/pages/{page.name}")


def test_docs_build_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "docs" / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:] + (
        "\n(mkdocs comes with the test install: pip install -e '.[test]')")
    assert (tmp_path / "site" / "operators" / "index.html").is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_leads_somewhere(page: Path) -> None:
    bad: list[str] = []
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http(s), mailto: outside the repository
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_is_valid(page: Path, tmp_path: Path) -> None:
    blocks = FENCE.findall(page.read_text())
    for i, (lang, body) in enumerate(blocks):
        where = f"{page.name}, code block {i + 1} ({lang or 'plain'})"
        if lang == "bash":
            done = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, f"{where}: {done.stderr}"
        elif lang == "python":
            compile(body, where, "exec")
        elif lang == "toml":
            tomllib.loads(body)


def test_quick_start_commands_are_what_ci_runs_or_run_here(tmp_path: Path) -> None:
    """Every command of the README's quick start is run by a test: the install and the test command by ``.ci/run``
    (checked here to be the same text), the rest here: the main job (one round), the weights it set read back, the
    Python client against it while it runs, and the real-model job when the real extra is installed."""
    section = _quick_start()
    blocks = FENCE.findall(section)
    bash = [c for lang, body in blocks if lang == "bash" for c in _commands(body)]
    python = [body for lang, body in blocks if lang == "python"]
    ci = re.sub(r"\s+", " ", (REPO / ".ci" / "run").read_text().replace("\\\n", " "))
    local: list[list[str]] = []
    weights: list[list[str]] = []
    for cmd in bash:
        if cmd.startswith("python3 -m venv"):
            install = cmd.split(" && (command -v redis-server")[0]
            assert install in ci, f"the README's install is not what .ci/run runs: {install}"
            assert "redis-server" in ci and "prometheus" in ci
        elif cmd == "bash scripts/field_vllm.sh prepare":
            assert cmd in ci
        elif cmd.startswith(".venv/bin/ruff check ."):
            for part in cmd.split(" && "):
                assert part in ci, f"the README's test command is not what .ci/run runs: {part}"
        elif cmd.startswith(".venv/bin/python -m neurons.validator --local --local.validators"):
            continue  # run as given, in compressed time, by tests/test_local_validators.py
        elif cmd.startswith(".venv/bin/python -m neurons.validator --local"):
            local.append(shlex.split(cmd)[1:])
        elif cmd.startswith(".venv/bin/python -m neurons.weights"):
            weights.append(shlex.split(cmd)[1:])
        else:
            pytest.fail(f"a quick-start command no test runs: {cmd}")
    assert local and weights and python, "the quick start lost its main job, its weights command or its client"
    sim = [a for a in local if "real" not in a]
    real = [a for a in local if "real" in a]
    assert len(sim) == 1
    state = tmp_path / "state"
    _run_local(sim[0], state, python)
    for argv in weights:
        argv = [str(state) if a == "~/.tensorgate/local" else a for a in argv]
        done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "uid" in done.stdout.lower() or "weight" in done.stdout.lower(), done.stdout
    assert len(real) == 1  # run as given by the test below


def test_the_readme_real_model_demo_says_who_was_paid_and_who_was_caught(tmp_path: Path) -> None:
    """Issue 62 (in part): the README's real-model command, run as given, ends after the rounds it asked for (it said
    "stopped after 7 rounds" for 6) with one line saying who was paid and who was caught and why, and the cheat at
    weight 0. Both honest miners weighted is printed, not asserted: one of them is still left unmeasured, and so
    unpaid, in about half the runs quiet, and beside two CPU hogs the run can end with no weights at all, which it
    then says (the note of the stop that added this test gives the figures)."""
    if os.environ.get("TENSORGATE_SKIP_REAL") == "1":
        pytest.skip("the '.[real]' extra is skipped (TENSORGATE_SKIP_REAL=1)")
    blocks = FENCE.findall(_quick_start())
    real = [shlex.split(c)[1:] for lang, body in blocks if lang == "bash" for c in _commands(body)
            if c.startswith(".venv/bin/python -m neurons.validator --local") and "real" in c]
    assert len(real) == 1, real
    state = tmp_path / "real"
    done = subprocess.run([sys.executable, *real[0], "--gateway.port", "0", "--state-dir", str(state)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    rounds = int(real[0][real[0].index("--local.rounds") + 1])
    assert f"local subnet stopped after {rounds} rounds" in said, said[-3000:]
    shown = subprocess.run([sys.executable, "-m", "neurons.weights", "--state-dir", str(state), "--netuid", "1",
                            "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    w = {row["miner_uid"]: row["weight"] for row in json.loads(shown.stdout)["weights"]}
    if not w:  # beside two CPU hogs no capacity check read a miner in 3 rounds (CI, 2026-12-08): it says so
        assert "no weights were set" in said, said[-3000:]
        print("\nthe README's real-model demo set no weights (a loaded machine)")
        return
    labels = dict(re.findall(r"uid +(\d+) (cheat: \S+|llama\.cpp gemma-3-270m \(CPU\)) +weight", said))
    cheats = {int(u) for u, label in labels.items() if label.startswith("cheat")}
    honest = {int(u) for u, label in labels.items() if not label.startswith("cheat")}
    assert len(cheats) == 1 and len(honest) == 2, said[-3000:]
    assert all(w.get(u, 0.0) == 0.0 for u in cheats) and sum(w.get(u, 0.0) for u in honest) > 0.99, w
    verdict = next(line for line in said.splitlines() if line.startswith("paid: "))
    paid, caught = verdict.split(";")
    assert all((f"uid {u} " in paid) == (w.get(u, 0.0) > 0) for u in honest), verdict
    assert f"uid {next(iter(cheats))} (cheat: random: " in caught and "audits failed" in caught, verdict
    print(f"\nthe README's real-model demo: honest weights {sorted(w.get(u, 0.0) for u in honest)}")


def _run_local(argv: list[str], state: Path, clients: list[str]) -> None:
    """The main job as the README gives it, on a free port and a state folder of the test's, for one round; each
    client snippet is run against its gateway (the banner's URL and key) while it serves."""
    assert argv[:2] == ["-m", "neurons.validator"], argv
    proc, url, key, lines = start_local_job([*argv[2:], "--gateway.port", "0", "--state-dir", str(state),
                                             "--local.rounds", "1"], REPO)
    try:
        for snippet in clients:
            code = snippet.replace("http://127.0.0.1:8000/v1", f"{url}/v1").replace("<key from the banner>", key)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr
        _, rest = proc.communicate(timeout=180)
        assert proc.returncode == 0, "".join(lines[-20:]) + (rest or "")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_page_has_sections_a_reader_can_navigate() -> None:
    """At least three ``##`` sections a page (issue 59), so the site's table of contents has entries to link to."""
    pages = sorted((REPO / "docs" / "pages").glob("*.md"))
    counts = {p.name: sum(1 for line in p.read_text().splitlines() if line.startswith("## ")) for p in pages}
    assert {name: n for name, n in counts.items() if n < 3} == {}
