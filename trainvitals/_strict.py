"""``TRAINVITALS_STRICT``: raise instead of warning where trainvitals tolerates its own failures.

A module of its own because both the callback guard (``trainvitals.callbacks.base``) and the
router capture (``trainvitals.moe.capture``) read it, and capture cannot import the callbacks
package (it imports capture).
"""

from __future__ import annotations

import os


def strict() -> bool:
    """True when ``TRAINVITALS_STRICT`` is set to anything but ``""``, ``0`` or ``false``; read
    at every call, so a test or a debugging session can switch it on at run time."""
    return os.environ.get("TRAINVITALS_STRICT", "0") not in ("", "0", "false", "False")
