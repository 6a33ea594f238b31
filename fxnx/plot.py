"""Matplotlib figures sized for a paper column: credit per depth, alignment per layer, census.

matplotlib (``pip install fxnx[plot]``) is imported when a figure is made.
"""

from ._plot import plot_alignment, plot_census, plot_credit_by_depth

__all__ = ["plot_alignment", "plot_census", "plot_credit_by_depth"]
