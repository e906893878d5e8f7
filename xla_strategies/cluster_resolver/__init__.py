"""Cluster resolvers, as `tf.distribute.cluster_resolver`: each says which tasks form the
cluster and which one this process is, and `MultiWorkerMirroredStrategy` (or
`ParameterServerStrategy`) takes any of them in place of `TF_CONFIG`.

- `TFConfigClusterResolver`, `SimpleClusterResolver` (`xla_strategies.cluster_resolver.tf_config`);
- `SlurmClusterResolver`: a Slurm job step's environment;
- `TPUClusterResolver`: a Cloud TPU VM slice's environment;
- `KubernetesClusterResolver`, `GCEClusterResolver`: through their services' clients;
- `UnionResolver`: several of them as one cluster.
"""

from xla_strategies.cluster_resolver.cloud import GCEClusterResolver, KubernetesClusterResolver
from xla_strategies.cluster_resolver.slurm import SlurmClusterResolver
from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver, TFConfigClusterResolver
from xla_strategies.cluster_resolver.tpu_cluster_resolver import TPUClusterResolver
from xla_strategies.cluster_resolver.union import UnionResolver

__all__ = [
    "GCEClusterResolver",
    "KubernetesClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "UnionResolver",
]
