"""A graph's costs as tables: per node and per module, as lists of rows or pandas DataFrames.

pandas (``pip install fxnx[frames]``) is needed by :func:`to_frames` only.
"""

from ._frames import cost_summary, cost_table, module_costs, to_frames

__all__ = ["cost_summary", "cost_table", "module_costs", "to_frames"]
