"""The machines: topologies and their links, device resolution, libtpu's start-up, and
the reader of XLA's compiled programs (HLO, the compiled report). Imports core and the
passes' IR and cost model."""
