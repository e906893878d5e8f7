"""The bridge to JAX: capture of a traced step into the IR, the trace-time hooks that mark
autodiff's reductions, the table of JAX ops the IR knows, and the lowering back to JAX."""
