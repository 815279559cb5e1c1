"""Sphinx configuration of the quack_jax documentation.

Build (from the repository root, with ``pip install -e ".[docs]"``)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

Every code cell of the guides runs at every build, on whatever JAX finds (on a machine
without a supported GPU, quack_jax's XLA fallback); a cell that raises fails the build.
"""

from __future__ import annotations

import os
from pathlib import Path

from sphinx import addnodes

import quack_jax

# -- project ---------------------------------------------------------------------------

project = "quack_jax"
author = "the quack_jax authors"
copyright = "the quack_jax authors"
version = release = quack_jax.__version__

# -- extensions ------------------------------------------------------------------------

extensions = [
    "myst_nb",  # MyST Markdown, and the guides as text notebooks executed at build time
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings are Google style (Args:, Returns:)
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "jupyter_execute"]

# MyST
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # `[x](page.md#a-heading)` links to headings of levels 1-3

# MyST-NB: run every notebook at every build; an error in a cell fails the build
nb_execution_mode = "force"
nb_execution_timeout = 120
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# autodoc and napoleon
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # show `eps=1e-6`, not its repr after evaluation
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- HTML ------------------------------------------------------------------------------

html_theme = "sphinx_book_theme"
html_title = f"quack_jax {version}"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_static_path: list[str] = []  # docs/_static holds only the site's screenshots
html_show_sourcelink = False


# -- links to repository files outside docs/ -------------------------------------------


def _repository_files_as_downloads(app, doctree):
    """A Markdown link to a ``.md`` file outside ``docs/`` (a benchmark's table, say)
    becomes a download of that file, as links to other files outside ``docs/`` already
    are; MyST would otherwise take it for a missing document. Links to ``.md`` files
    that exist nowhere stay references, and so still fail the build."""
    srcdir = Path(app.srcdir).resolve()
    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("refdomain") != "doc" or node.get("reftype") != "myst":
            continue
        target = node["reftarget"]
        if target in app.env.found_docs:
            continue
        base = Path(target) if os.path.isabs(target) else srcdir / target
        found = [base.with_name(base.name + s) for s in app.config.source_suffix]
        found = [p.resolve() for p in found if p.is_file()]
        if not found or found[0].is_relative_to(srcdir):
            continue
        docdir = (srcdir / app.env.docname).parent
        download = addnodes.download_reference(
            refdomain=None,
            reftarget=os.path.relpath(found[0], docdir),
            refdoc=app.env.docname,
            reftype="myst",
            refexplicit=node.get("refexplicit", True),
        )
        download.source, download.line = node.source, node.line
        download += node.children
        node.replace_self(download)


def setup(app):
    # before the environment collects each document's downloads (priority 500)
    app.connect("doctree-read", _repository_files_as_downloads, priority=100)
