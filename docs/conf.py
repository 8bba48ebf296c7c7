project = "ztwisted"
author = "the ztwisted developers"
copyright = "2026, the ztwisted developers"
extensions = []
html_theme = "alabaster"
exclude_patterns = ["_build"]
