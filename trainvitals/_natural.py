"""Natural order of names and labels: the integers inside them compared as numbers
(``layer_2`` before ``layer_10``, label ``"2"`` before ``"10"``). Used wherever layers or
groups are listed: the report and query rows, NormMonitor's ``group_by`` labels."""

from __future__ import annotations

import re

_NUMBERS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple:
    """Sort key that orders the integers inside ``text`` as numbers. The captures, at odd
    places of the split, are the numbers (``str.isdigit`` is also true of "²", which ``int()``
    refuses: a name holding one failed the sort)."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_NUMBERS.split(text)))


def natural_order(label: str) -> tuple:
    """:func:`natural_key`, then the label itself: labels of one natural key (``"01"`` and
    ``"1"``) come in one order whatever the order they were found in (sorted from a set by
    the natural key alone, their order followed Python's string hashing, which changes from
    process to process: every rank or run must list them alike)."""
    return natural_key(label), label
