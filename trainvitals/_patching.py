"""Instance attributes set over an object's methods for a while, and taken back."""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class AttributePatch:
    """Set ``obj.<name> = value`` as an instance attribute (over the class's method) now;
    :meth:`undo` puts back what the instance held before (nothing, or another wrapper), unless
    something else has replaced ``value`` since, which is then left as it is."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value
        self._before = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)

    def undo(self) -> None:
        if vars(self.obj).get(self.name, _ABSENT) is not self.value:
            return
        if self._before is _ABSENT:
            delattr(self.obj, self.name)  # the class's own method again
        else:
            setattr(self.obj, self.name, self._before)
