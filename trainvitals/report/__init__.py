"""Reading a run's files back: exact queries over tensor groups (:func:`query`).

``import trainvitals.report`` needs torch only.
"""

from __future__ import annotations

from trainvitals.report.query import parse_steps, query, read_tensor_stats

__all__ = ["parse_steps", "query", "read_tensor_stats"]
