"""``python -m ztwisted.tools.lab``: the ``ztunnel-lab`` command."""

import sys

from ztwisted.tools.lab.cli import main

sys.exit(main())
