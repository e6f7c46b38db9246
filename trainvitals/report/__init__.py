"""Reading a run's files back: exact queries over tensor groups (:func:`query`) and a
self-contained HTML report (:func:`write_report`).

``import trainvitals.report`` needs torch only.
"""

from __future__ import annotations

from trainvitals.report.html import render_report, write_report
from trainvitals.report.query import parse_steps, query, read_tensor_stats

__all__ = ["parse_steps", "query", "read_tensor_stats", "render_report", "write_report"]
