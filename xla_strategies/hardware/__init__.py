"""The machines: topologies and their links, device resolution, JAX's accelerator plugins
where their chips are absent, XLA's GPU compiler without a GPU, and the reader of
compiled programs (HLO, its matmul flops, the compiled report). Imports core and the
passes' IR and cost model."""
