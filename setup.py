"""Installs the top-level ``plugins/`` folder as Twisted dropins (``twisted.plugins``).

setup.cfg holds the metadata; the folder-to-package mapping for a namespace
that belongs to Twisted cannot be written there.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["ztwisted", "ztwisted.*"]) + ["twisted.plugins"],
    package_dir={"twisted.plugins": "plugins"},
)
