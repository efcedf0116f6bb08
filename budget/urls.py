"""SGLang server URLs as budgetq is given them: ``SGLANG_URL`` (read by the workers, and by ``produce --dry-run
--pilot``) and ``produce export --server-url``. One comma-separated list, parsed by one function, so the three
agree on what a list may hold.

Shared by the producer and the workers (both import budget/, never each other); only their entry points read the
environment and hand the text here.
"""
from __future__ import annotations

from typing import Final

#: Where a worker (and ``--pilot``) sends requests when SGLANG_URL is not set: SGLang's default port, on the host.
DEFAULT_SGLANG_URL: Final = "http://127.0.0.1:30000"


def server_urls(raw: str, name: str = "SGLANG_URL") -> tuple[str, ...]:
    """The URLs of the comma-separated list ``raw``, each stripped of spaces and of a trailing slash.

    Raises ValueError, its message starting with ``name``, when the list is empty or a URL is not http(s): a URL
    without its scheme (``sglang:30000``) would otherwise fail at its first request, far from where it was given."""
    urls = tuple(u.strip().rstrip("/") for u in raw.split(",") if u.strip())
    if not urls:
        raise ValueError(f"{name} is empty")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name}: {url!r} is not an http(s) URL")
    return urls
