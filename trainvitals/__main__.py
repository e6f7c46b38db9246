"""``python -m trainvitals ...``: the same as the ``trainvitals`` command."""

import sys

from trainvitals.cli import main

sys.exit(main())
