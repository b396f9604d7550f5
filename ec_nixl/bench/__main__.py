"""``python -m ec_nixl.bench`` = ``ec-nixl bench``."""

import sys

from ec_nixl.bench.command import main

sys.exit(main())
