"""One id per request, so a client, the gateway's logs and an operator can talk about the same request.

Taken from the client's ``X-Request-Id`` when it is a sane token (1-128 characters of letters, digits and
``._:-``: what proxies and tracing systems send), made otherwise (``req_`` and 24 hex digits). The gateway returns
it in the ``X-Request-Id`` header of every answer and in the OpenAI error body (``error.request_id``), and
every log line written while serving the request carries it (loguru's ``extra["request_id"]``).

Example::

    request_id("abc-123")     # 'abc-123'
    request_id("bad id\\n")    # 'req_9f1c...' (made: the client's was not a token)
"""

from __future__ import annotations

import random
import re

HEADER = "X-Request-Id"
_TOKEN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_IDS = random.Random()  # unique, not secret: no urandom syscall per request


def request_id(given: str | None) -> str:
    """The client's id when it is a sane token, else a new one."""
    if given is not None and _TOKEN.fullmatch(given):
        return given
    return f"req_{_IDS.getrandbits(96):024x}"
