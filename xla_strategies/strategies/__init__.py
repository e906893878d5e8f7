"""The strategies (OneDevice, Mirrored, MultiWorkerMirrored, TPU, CentralStorage,
ParameterServer) and the default strategy. Imports distribute and everything below it."""
