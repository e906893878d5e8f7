"""The `xla-strategies` command line (`demo`, `dump`, `aot`, `plan`, `report`, `show`,
`opt`, `ledger`). The top layer: it imports the layers below the frontends, and the demo
(`tests/test_imports.py`)."""
