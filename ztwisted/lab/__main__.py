"""``python -m ztwisted.lab``: the ``ztunnel-lab`` command."""

import sys

from ztwisted.lab.cli import main

sys.exit(main())
