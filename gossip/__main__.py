"""``python -m gossip``: the ``gossip-train`` command (:mod:`gossip.app.cli`)."""

import sys

from gossip.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
