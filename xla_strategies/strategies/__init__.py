"""The strategies (OneDevice, Mirrored, MultiWorkerMirrored, TPU, CentralStorage,
ParameterServer), the default strategy, and what they share: tf's logical devices and
partitioners, GPU nodes to compile for. Imports distribute and everything below it."""
