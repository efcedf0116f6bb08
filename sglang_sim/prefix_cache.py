"""A cheap stand-in for SGLang's radix (prefix) cache, to fill `meta_info.cached_tokens`.

SGLang matches a new prompt against a radix tree of KV pages kept from earlier requests. Here a
prompt is cut into fixed pages and each page is keyed by the hash of the whole prefix up to its end
(a hash chain), so "is this prefix cached?" is one dict lookup per page. Keys live in an LRU of
bounded size. Matches are page-granular, so cached_tokens may under-count by up to a page, and
evicting a middle page shortens later matches; both are fine for a simulator.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


class PrefixCache:
    """LRU of prefix-page keys; `capacity_pages == 0` disables caching."""

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def match_and_insert(self, tokens: Sequence[Hashable]) -> int:
        """Tokens of `tokens` already cached (at most len - 1: the last one is always computed),
        then remember all of `tokens`' full pages as cached."""
        if self.capacity_pages == 0 or not tokens:
            return 0
        page = self.page_size
        matched = 0
        still_matching = True
        key = 0
        pages = self._pages
        for start in range(0, len(tokens) - page + 1, page):
            key = hash((key, tuple(tokens[start : start + page])))
            if key in pages:
                pages.move_to_end(key)
                if still_matching:
                    matched += page
            else:
                still_matching = False
                pages[key] = None
        while len(pages) > self.capacity_pages:
            pages.popitem(last=False)
        return min(matched, len(tokens) - 1)

    def clear(self) -> None:
        """Forget everything (SGLang's /flush_cache)."""
        self._pages.clear()
