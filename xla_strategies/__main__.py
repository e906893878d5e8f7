"""`python -m xla_strategies ...`: the `xla-strategies` command line."""

import sys

from xla_strategies.cli.main import main

sys.exit(main())
