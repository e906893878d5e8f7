"""PyTorch: a `torch.nn.Module`, a loss written in torch and a `torch.optim` (or optax)
optimizer, trained by `@strategy.compile` through torchax.

    import xla_strategies.torch as xst

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = xst.TrainState.create(model, optimizer)

    def compute_loss(model, images, labels):      # torch code, torch tensors
        return F.cross_entropy(model(images), labels)

    @strategy.compile
    def train_step(state, images, labels):
        return xst.train_step(state, compute_loss, images, labels)

    for images, labels in dist_dataset:
        state, loss = train_step(state, images, labels)
    model.load_state_dict(state.state_dict())

torchax runs the module's forward and the loss as JAX operations while the step is traced,
so the step is captured into the same IR as a JAX step and the same passes insert, combine
and decompose its reductions. Gradients are JAX's (`jax.value_and_grad` over the torch
forward), so the strategy's gradient reduction applies to them as to any JAX gradient.
PyTorch and torchax are imported when this package is: install `xla-strategies[torch]`.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import torchax  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "xla_strategies.torch needs PyTorch and torchax, which import together only at the "
        "versions the [torch] extra pins: pip install 'xla-strategies[torch]'"
    ) from exc

from xla_strategies.torch.step import apply, train_step
from xla_strategies.torch.train_state import TrainState

__all__ = ["TrainState", "apply", "train_step"]
