"""The compiled step: its signature and arguments, declared and in-place state, RNG
streams, the pipeline it runs, its dumps, and the compile. Imports core, passes, hardware
and runtime; reads a strategy through `core.strategy_like`."""
