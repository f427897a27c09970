"""Bit masks over routes or passes: the planner's sets, one Python int per node (fast on graphs of 10^4 nodes)."""

from __future__ import annotations


def bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, ascending."""
    out = []
    k = 0
    while mask:
        if mask & 1:
            out.append(k)
        mask >>= 1
        k += 1
    return out


def several(mask: int) -> bool:
    """Whether ``mask`` has more than one bit set."""
    return bool(mask & (mask - 1))
