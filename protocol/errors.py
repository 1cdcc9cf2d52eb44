"""The one exception of the leaf types: a value outside its declaration."""

from __future__ import annotations


class InvalidInput(ValueError):
    """A message, record or argument is malformed; the text says which field and why."""
