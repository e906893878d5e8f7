"""xla_strategies: tf.distribute's Strategy API for JAX, built as a compiler.

strategy = xs.MirroredStrategy()

@strategy.compile
def train_step(params, opt_state, batch): ...   # per-replica view
"""

from xla_strategies import cluster_resolver, experimental
from xla_strategies import keras as _keras_scope_hook  # noqa: F401  (registers it; imports no Keras)
from xla_strategies.core import errors
from xla_strategies.core.context import (
    ReplicaContext,
    get_replica_context,
    has_strategy,
    in_cross_replica_context,
)
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.distribute.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from xla_strategies.distribute.extended import StrategyExtended
from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware import accelerator_plugins as _plugins  # noqa: F401  (see there)
from xla_strategies.hardware.devices import emulate_cpu_devices
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes.bridge.axis_names import UnknownAxisError
from xla_strategies.passes.bridge.pipeline_boundary import pipeline_boundary
from xla_strategies.passes.bridge.step_mesh import ForeignMeshError
from xla_strategies.passes.transforms.insert_reductions import MirroredOutputError
from xla_strategies.runtime.checkpoint import CheckpointError, CheckpointManager
from xla_strategies.runtime.distributed_dataset import DistributedDataset, DistributedIterator
from xla_strategies.runtime.input_options import InputContext, InputOptions, InputReplicationMode
from xla_strategies.runtime.parameter_server.coordinator import ClusterCoordinator, RemoteValue
from xla_strategies.runtime.preemption import PREEMPTION_EXIT_CODE, PreemptionCheckpointHandler
from xla_strategies.step import numerics as debugging  # tf.debugging's check_numerics
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.compiled_step import CompiledStep
from xla_strategies.strategies import partitioners
from xla_strategies.strategies.central_storage import CentralStorageStrategy
from xla_strategies.strategies.default_strategy import experimental_set_strategy, get_strategy
from xla_strategies.strategies.mirrored import MirroredStrategy
from xla_strategies.strategies.multi_worker import CommunicationOptions, MultiWorkerMirroredStrategy
from xla_strategies.strategies.one_device import OneDeviceStrategy
from xla_strategies.strategies.parameter_server import ParameterServerStrategy
from xla_strategies.strategies.tpu import TPUStrategy

__version__ = "0.1.0"

__all__ = [
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "ParameterServerStrategy",
    "RemoteValue",
    "debugging",
    "errors",
    "partitioners",
    "CheckpointError",
    "CheckpointManager",
    "CommunicationOptions",
    "CompileOptions",
    "CompiledStep",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "ForeignMeshError",
    "HierarchicalCopyAllReduce",
    "InputReplicationMode",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "StrategyExtended",
    "experimental",
    "experimental_set_strategy",
    "MultiWorkerMirroredStrategy",
    "cluster_resolver",
    "InputContext",
    "InputOptions",
    "MirroredOutputError",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PREEMPTION_EXIT_CODE",
    "PreemptionCheckpointHandler",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "TPUStrategy",
    "Topology",
    "UnknownAxisError",
    "emulate_cpu_devices",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "pipeline_boundary",
]
