"""The `xla-strategies` command line (`dump`, `report`, `aot`, `demo`). The top layer:
imports anything."""
