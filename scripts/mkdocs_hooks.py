"""MkDocs hooks for the documentation site (mkdocs.yml: hooks).

The docstrings cross-reference in Sphinx's style (:class:`Stage`,
:func:`search`); rendered as Markdown those roles would show literally. Drop
the role and keep the name as code.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc):(?=<code>)")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
