"""Actor answers that cross the wire in one frame, whatever their length.

Dask sends an actor method's answer as ``to_serialize(result)``: a plain ``list``,
``tuple``, ``set`` or ``dict`` is serialized item by item (one frame per item, about
35 us each), an instance of a subclass is pickled whole. Methods whose answers grow with
the rows or calls they hold answer with these types.
"""
from __future__ import annotations


class WireList(list):
    """A list an actor method answers with, sent in ONE frame.

    Dask serializes a plain ``list``, ``tuple``, ``set`` or ``dict`` answer item by item
    (one frame per item: about 35 us each, so 5,000 keys cost 0.18 s instead of 1 ms);
    it pickles an instance of a subclass whole. Used for answers that grow with the rows
    held (key listings)."""


class WireDict(dict):
    """A dict an actor method answers with, sent in one frame (see :class:`WireList`)."""
