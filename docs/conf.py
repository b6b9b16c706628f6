"""Sphinx configuration of lgc's documentation site: MyST pages and the API reference from the docstrings.

Built offline (no intersphinx, no remote theme) with warnings as errors by the test suite
(``tests/test_docs.py``)::

    sphinx-build -W -b html docs docs/_build/html
"""

from importlib.metadata import version as _version

project = "lgc"
release = _version("lgc")
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# The docstrings are Google style (Args:, Returns:, Raises:) in reStructuredText.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Overrides of Lightning's and PyTorch's methods keep their own (foreign) docstrings out of the site.
autodoc_inherit_docstrings = False
autodoc_default_options = {"show-inheritance": True}

# Headings up to ### get anchors, so pages link to sections (evidence.md#which-method).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "lgc"
