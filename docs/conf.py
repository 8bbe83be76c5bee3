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
    "sphinxcontrib_trio",
]
# No intersphinx: the docs must build offline (CI and this workplace have no network).

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Only for parameters the docstring documents: Coordinator's no-public-constructor
# metaclass would otherwise show (*args, **kwargs) -> NoReturn.
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False

html_theme = "furo"
html_title = f"trio-debounce {release}"
exclude_patterns = ["_build"]
master_doc = "index"
