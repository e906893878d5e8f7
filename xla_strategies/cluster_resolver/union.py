"""`UnionResolver`: one cluster from several resolvers, as in tf.distribute."""

from __future__ import annotations

from typing import Any

from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver


class UnionResolver(SimpleClusterResolver):
    """The union of `resolvers`' clusters: a job several of them list gets their addresses
    in the order the resolvers are given. This task is `task_type`/`task_id` when given,
    else the first resolver's."""

    def __init__(
        self,
        *resolvers: SimpleClusterResolver,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if not resolvers:
            raise ValueError("UnionResolver needs at least one cluster resolver")
        cluster: dict[str, list[str]] = {}
        for index, resolver in enumerate(resolvers):
            if not hasattr(resolver, "cluster_spec"):
                raise TypeError(
                    f"UnionResolver argument {index} is a {type(resolver).__name__}, not a "
                    "cluster resolver (it has no cluster_spec())"
                )
            for job, addresses in resolver.cluster_spec().items():
                taken = set(cluster.get(job, [])) & set(addresses)
                if taken:
                    raise ValueError(
                        f"UnionResolver: resolver {index} lists {sorted(taken)} in job "
                        f"{job!r}, which an earlier resolver lists already"
                    )
                cluster.setdefault(job, []).extend(addresses)
        first = resolvers[0]
        super().__init__(
            cluster,
            first.task_type if task_type is None else task_type,
            first.task_id if task_id is None else task_id,
            rpc_layer=first.rpc_layer if rpc_layer is None else rpc_layer,
            _source="UnionResolver",
        )
        self.resolvers: tuple[Any, ...] = resolvers
