"""Step 2, passes: the routes merged into passes, each pass one backward of its routes' losses together."""

from __future__ import annotations

from dataclasses import dataclass, field

from .masks import bits
from .reach import Reach


@dataclass(frozen=True)
class Passes:
    """The passes, in merge order (not yet execution order).

    Attributes:
        routes: per pass, the mask of its routes.
        unreached: the routes whose losses reach none of their own parameters (in no pass).
    """

    routes: tuple[int, ...]
    unreached: tuple[int, ...]
    _pass_of: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _memo: dict[int, int] = field(default_factory=lambda: {0: 0}, repr=False, compare=False)

    def __post_init__(self) -> None:
        for k, mask in enumerate(self.routes):
            for r in bits(mask):
                self._pass_of[r] = k

    def of_routes(self, mask: int) -> int:
        """The mask of the passes holding the routes of ``mask`` (memoised: few distinct masks occur)."""
        out = self._memo.get(mask)
        if out is None:
            out = 0
            for r in bits(mask):
                k = self._pass_of.get(r)
                if k is not None:
                    out |= 1 << k
            self._memo[mask] = out
        return out


def merge_routes(found: Reach) -> Passes:
    """Greedy: each route joins the first pass none of whose routes it must run apart from."""
    n_routes = len(found.counts)
    unreached = tuple(r for r in range(n_routes) if found.counts[r][r] == 0)
    routes: list[int] = []
    for r in range(n_routes):
        if found.counts[r][r] == 0:
            continue
        for k, mask in enumerate(routes):
            if not (found.apart[r] & mask):
                routes[k] = mask | (1 << r)
                break
        else:
            routes.append(1 << r)
    return Passes(routes=tuple(routes), unreached=unreached)
