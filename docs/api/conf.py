"""Sphinx configuration of fxnx's API reference.

Build it as CI does (warnings are errors)::

    .venv/bin/sphinx-build -W --keep-going -b html docs/api build/api

The pages document the public names, ``fxnx.__all__``, from their numpy-style docstrings;
``tests/test_docs_build.py`` builds them and fails on a warning or on a public name that no
page documents. Everything here works offline: no intersphinx, no theme to download.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Document the checkout these pages belong to, whichever fxnx is installed.
ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "fxnx" / "__init__.py").is_file():
    sys.path.insert(0, str(ROOT))

import fxnx  # noqa: E402

project = "fxnx"
author = "The fxnx authors"
copyright = "2026 The fxnx authors (MIT License)"
version = release = fxnx.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# numpydoc sections (Parameters, Returns, Raises, Examples); Google style is not used.
napoleon_google_docstring = False
napoleon_numpy_docstring = True

# Signatures keep the annotations as written; the Parameters sections say the rest.
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True

html_theme = "alabaster"
html_title = f"fxnx {release}"
exclude_patterns = ["_build"]
