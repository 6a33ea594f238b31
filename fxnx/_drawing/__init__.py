"""Drawing a graph, as a pipeline a reader can follow in order (:mod:`.draw` runs it):

1. :mod:`.view`: what of ``G`` is drawn, on a copy: checks left out, modules collapsed,
   parameters listed on their one reader, skip connections marked;
2. :mod:`.style`: palette, fonts and their sizes, labels and legend;
3. :mod:`.estimate` and :mod:`.fit`: the layout's size predicted from the styled labels
   before Graphviz runs, and every decision made from it: the depth of a PNG (one search),
   and what to say when nothing fits;
4. :mod:`.dot`: the DOT text, through pydot;
5. :mod:`.graphviz`: the one run of Graphviz's ``dot``, and the :class:`~fxnx.Drawing`.
"""

from . import view, style, estimate, fit, dot, graphviz, draw  # noqa: F401, I001  (in pipeline order)
