"""``python -m mtpserve``: the same as the ``mtpserve`` command."""

import sys

from mtpserve import main

sys.exit(main())
