"""``python -m gradroute``: the ``gradroute`` command (see :mod:`gradroute.cli`)."""

import sys

from gradroute.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
