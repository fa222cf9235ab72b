"""Quantities as people read them (no eagle3 imports: any module may use these)."""


def fmt_size(n: float) -> str:
    """Bytes as a short human-readable size (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
