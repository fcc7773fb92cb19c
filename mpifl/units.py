"""Byte units, defined once, and how a byte count, a count of things and a list of integers are printed."""
from collections.abc import Iterable

KIB = 2**10
MIB = 2**20
GIB = 2**30


def format_bytes(count: float) -> str:
    """A byte count in the largest binary unit that keeps it at least 1: '512 B', '3.4 KiB', '1.44 GiB'."""
    for size, unit in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if abs(count) >= size:
            return f"{count / size:,.2f} {unit}"
    return f"{count:,.0f} B"


def range_list(values: Iterable[int], separator: str = ",") -> str:
    """Integers as a compact range list: [0, 1, 2, 3, 8] -> '0-3,8' ('' for none)."""
    parts: list[list[int]] = []
    for value in sorted(set(values)):
        if parts and parts[-1][1] == value - 1:
            parts[-1][1] = value
        else:
            parts.append([value, value])
    return separator.join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """A count with its noun in the right number: '1 client rank', '2 client ranks', '1 group of 2 ranks'
    (``plural``: where adding an 's' to the noun's end is wrong)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def rank_span(first: int, last: int) -> str:
    """Consecutive ranks as a reader says them: 'rank 1', 'ranks 1-4'."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
