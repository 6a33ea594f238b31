"""The graph contract as data: every attribute an fxnx graph may hold, and the file format.

:func:`fxnx.validate` checks a graph against these tables; ``docs/graph.md`` is generated
from the same entries and kept true to them by a test.
"""

from ._contract import EDGE_ATTRIBUTES, GRAPH_ATTRIBUTES, NODE_ATTRIBUTES, Attribute
from ._version import FORMAT_VERSION

__all__ = ["Attribute", "EDGE_ATTRIBUTES", "FORMAT_VERSION", "GRAPH_ATTRIBUTES", "NODE_ATTRIBUTES"]
