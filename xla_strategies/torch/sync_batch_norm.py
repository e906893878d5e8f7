"""`torch.nn.SyncBatchNorm` across the strategy's replicas.

PyTorch's SyncBatchNorm gathers batch statistics through `torch.distributed`, and when
no process group is initialized (as in a compiled step) it quietly normalizes with each
replica's own statistics. While a step is traced its forward computes the statistics of
the global batch instead, with the replica context's mean: the mean, then the variance
around it (every replica holds the same number of rows, so a mean of means is exact).
The running statistics are updated from those, with the unbiased variance of the global
batch, so they are the same on every replica. The result equals BatchNorm on one device
over the whole batch, which is what a user converting with `convert_sync_batchnorm` asks for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torchax import interop

from xla_strategies.core.context import get_replica_context
from xla_strategies.core.patching import patched


@contextlib.contextmanager
def synced_batch_norm() -> Iterator[None]:
    """While active, SyncBatchNorm in training mode uses the global batch's statistics."""
    with patched(torch.nn.SyncBatchNorm, "forward", _synced_forward):
        yield


def _synced_forward(original: Any) -> Any:
    def forward(self: torch.nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
        context = get_replica_context()
        if not self.training or context is None or context.num_replicas_in_sync == 1:
            return original(self, input)
        if self.momentum is None:
            raise ValueError(
                "SyncBatchNorm(momentum=None) (a cumulative average) is not supported in a "
                "compiled step; give it a momentum"
            )

        def global_mean(t: torch.Tensor) -> torch.Tensor:
            return interop.call_jax(lambda a: context.all_reduce("mean", a), t)

        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        mean = global_mean(input.mean(dims))
        centred = input - mean.reshape(shape)
        var = global_mean((centred * centred).mean(dims))
        if self.track_running_stats:
            rows = input.numel() // input.shape[1] * context.num_replicas_in_sync
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                self.running_mean.mul_(1 - self.momentum).add_(mean * self.momentum)
                unbiased = var * (rows / (rows - 1))
                self.running_var.mul_(1 - self.momentum).add_(unbiased * self.momentum)
        out = centred * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out

    return forward
