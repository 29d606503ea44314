"""A match: the cached prefix of one prompt, as found by :meth:`PrefixCache.match`."""

from __future__ import annotations

import dataclasses

from kvpool.cache.tree import Node, Tier


@dataclasses.dataclass(eq=False)
class Match:
    """The cached prefix of one prompt.

    Attributes:
        num_pages: full pages usable from the start of the prompt.
        page_size: tokens per page.
        tiers: the :class:`Tier` per page where it was found (a StrEnum: compares equal
            to "L1", "L2", "L3").
        nodes: the radix-tree part (locked until :meth:`PrefixCache.release`).
        l3_keys, l3_tokens: page keys and token bytes of the pages found only in L3.
        locked: the deepest node this match holds locked (None: none).
        loaded: :meth:`PrefixCache.load` ran (its L3 hits and losses are counted).
    """

    num_pages: int
    page_size: int
    tiers: list[Tier]
    nodes: list[Node]
    l3_keys: list[bytes]
    l3_tokens: list[bytes]
    locked: Node | None = None
    released: bool = False
    loaded: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the match (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Tokens per tier the pages were found in, e.g. ``{"L1": 32, "L3": 16}``; after
        :meth:`PrefixCache.load`, only the pages it returned (the cut ones are gone).
        Keys are plain strings (user-facing: engine results and JSON)."""
        by_tier: dict[str, int] = {}
        for tier in self.tiers[:self.num_pages]:
            by_tier[str(tier)] = by_tier.get(str(tier), 0) + self.page_size
        return by_tier

    def truncate(self, num_pages: int) -> None:
        """Cut the L3 part so that only ``num_pages`` pages remain."""
        keep = num_pages - len(self.nodes)
        assert keep >= 0
        self.num_pages = num_pages
        self.tiers = self.tiers[:num_pages]
        self.l3_keys = self.l3_keys[:keep]
        self.l3_tokens = self.l3_tokens[:keep]
