"""Counting a prompt's tokens with the subnet model's own tokenizer, for the API keys' token limits.

Why: the gateway's estimate (4 characters a token, :mod:`gateway.protocol.tokens`) undercounts what the
model really spends on digits (3.98x against Gemma's tokenizer), emoji (3.94x) and CJK (1.77x), so a key
could use about 4x its ``tpm``/``tpd`` (issue 24 item 6). This counts the prompt as the model sees it: the
chat template rendered, then tokenized with the GGUF file's own vocabulary (llama.cpp's ``vocab_only``:
no weights, a fraction of a second to load).

Tokenizing is CPU work that grows with the prompt (0.3 ms for 1,000 digits, ~0.9 s for a 1 MB prompt on
this machine), so it runs on a thread of its own, one prompt at a time, never on the event loop; the gateway
asks it only for keys that have a token limit.

Example::

    counter = GgufTokenCounter(None)        # the packaged Gemma 3 270M; or a GGUF path
    await counter.start()
    await counter.count([{"role": "user", "content": "1234567890"}])   # 10 digits: 10 tokens + the template's
    await counter.aclose()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

from .chat_template import render
from .packaged import MODEL_ID, ModelUnavailable, model_path, require_runtime


class GgufTokenCounter:
    """A GGUF model's tokenizer on one thread; :meth:`count` is the prompt's tokens as the model sees them."""

    def __init__(self, path: Path | None) -> None:
        self.name = f"tokenizer of {MODEL_ID if path is None else path.name}"
        self._path = path
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._vocab: Any = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._vocab = await loop.run_in_executor(self._pool, self._load)

    def _load(self) -> Any:
        require_runtime()
        import llama_cpp

        path = self._path if self._path is not None else model_path()
        if not path.is_file():
            raise ModelUnavailable(f"tokenizer model {path}: no such file")
        try:
            return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise ModelUnavailable(f"llama.cpp could not load the vocabulary of {path}: {e}") from e

    async def count(self, messages: list[dict[str, Any]]) -> int:
        if self._vocab is None:
            raise RuntimeError("tokenizer not started")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._count, messages)

    def _count(self, messages: list[dict[str, Any]]) -> int:
        return len(self._vocab.tokenize(render(messages).encode("utf-8", "replace"), add_bos=True, special=True))

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._vocab = None
