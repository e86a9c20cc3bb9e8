"""`python -m server.cli`: the same as the `sdserve` console script."""

import sys

from server.cli.main import main

sys.exit(main())
