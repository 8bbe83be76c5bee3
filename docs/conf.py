"""Sphinx configuration for trio_debounce."""

from __future__ import annotations

import trio_debounce

project = "trio-debounce"
author = "The trio_debounce developers"
copyright = "2026, The trio_debounce developers"
version = release = trio_debounce.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinxcontrib_trio",
]
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "trio": ("https://trio.readthedocs.io/en/stable", None),
}
# No network here: intersphinx inventories are optional, so a failed fetch must not
# turn into an error under -W.
suppress_warnings = ["intersphinx"]
intersphinx_timeout = 5

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_type_aliases = {"Handler": "trio_debounce.Handler", "OnExit": "trio_debounce.OnExit"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False

html_theme = "furo"
html_title = f"trio-debounce {release}"
exclude_patterns = ["_build"]
master_doc = "index"
