"""Kubernetes resource quantities ("44", "700m", "176Gi", "1.5e3") as numbers, without the kubernetes client
(preflight, which compares them, imports neither kopf nor kubernetes)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)$")


def parse(value: str | int | float) -> Decimal:
    """The quantity's value in base units (cores, bytes); ValueError names what does not parse."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation as error:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from error


def milli(value: str | int | float) -> int:
    """CPU in millicores, rounded up as the scheduler does."""
    return int((parse(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def whole(value: str | int | float) -> int:
    """Bytes (memory, ephemeral-storage) or a count, rounded up."""
    return int(parse(value).to_integral_value(rounding="ROUND_CEILING"))


def human_bytes(value: int) -> str:
    """Bytes as the largest binary unit that keeps one decimal: 536870912000 -> '500Gi'."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if value >= unit:
            shown = value / unit
            return f"{shown:.0f}{suffix}" if shown == int(shown) else f"{shown:.1f}{suffix}"
    return str(value)
