"""The command-line tools (``tools/*.py`` call these ``main`` functions): one-line errors, exit 2 on bad input."""
