"""Byte units, defined once, and how a byte count is printed."""
KIB = 2**10
MIB = 2**20
GIB = 2**30


def format_bytes(count: float) -> str:
    """A byte count in the largest binary unit that keeps it at least 1: '512 B', '3.4 KiB', '1.44 GiB'."""
    for size, unit in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if abs(count) >= size:
            return f"{count / size:,.2f} {unit}"
    return f"{count:,.0f} B"
