"""`xs.experimental`: what tf.distribute keeps under `tf.distribute.experimental`."""

from xla_strategies.distribute.cross_device_ops import (
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
)
from xla_strategies.distribute.values import ValueContext
from xla_strategies.experimental import coordinator
from xla_strategies.runtime.distributed_dataset import OptionalValue as Optional
from xla_strategies.runtime.preemption import PreemptionCheckpointHandler, TerminationConfig
from xla_strategies.strategies import partitioners
from xla_strategies.strategies.central_storage import CentralStorageStrategy
from xla_strategies.strategies.multi_worker import MultiWorkerMirroredStrategy
from xla_strategies.strategies.parameter_server import ParameterServerStrategy
from xla_strategies.strategies.tpu import TPUStrategy

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "Optional",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
]
