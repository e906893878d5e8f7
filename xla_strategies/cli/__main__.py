"""`python -m xla_strategies.cli ...`: the `xla-strategies` command line, as before the
package had layers (`python -m xla_strategies` is the shorter spelling)."""

import sys

from xla_strategies.cli.main import main

sys.exit(main())
