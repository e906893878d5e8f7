"""Small PyTorch models written as PyTorch's own tutorials write them, and an eager-torch
data-parallel reference computed on one device."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests.frameworks.reference import R


class Net(nn.Module):
    """The CIFAR-10 tutorial's network, with BatchNorm after each convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


class TinyLM(nn.Module):
    """A causal transformer language model in the style of PyTorch's word-language-model
    example: embedding, `nn.TransformerEncoder`, a decoder tied to the embedding.

    The layers have no biases: attention's key bias has an exactly zero gradient (softmax
    ignores a constant added to every score), and Adam turns the float32 noise in a zero
    gradient into steps of +-lr, so no two implementations agree on it."""

    def __init__(self, vocab: int = 32, d_model: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=32, dropout=0.0, batch_first=True, bias=False
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = nn.Linear(d_model, vocab)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.decoder(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def classification_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor):
    return F.cross_entropy(model(images), labels.long())


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def image_batches(steps: int, rows: int = 32, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, 3, 8, 8)).astype(np.float32),
            rng.integers(0, 10, rows).astype(np.int32),
        )
        for _ in range(steps)
    ]


def token_batches(steps: int, rows: int = 16, length: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, 32, (rows, length)).astype(np.int32),
            rng.integers(0, 32, (rows, length)).astype(np.int32),
        )
        for _ in range(steps)
    ]


def eager_data_parallel(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: Callable[..., torch.Tensor],
    batches: list[tuple[np.ndarray, ...]],
    replicas: int = R,
    make_scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
    max_grad_norm: float | None = None,
) -> tuple[nn.Module, list[dict[str, torch.Tensor]], list[float]]:
    """Data parallelism in eager torch on one device, as DDP defines it: each replica's
    loss on its slice of the batch with its own buffers, the gradient of their mean
    (clipped with `clip_grad_norm_` where `max_grad_norm` is given), one optimizer step.
    Returns the model, each replica's buffers and the mean losses."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    buffers = [{k: b.clone() for k, b in model.named_buffers()} for _ in range(replicas)]
    losses = []
    for batch in batches:
        parts = [torch.from_numpy(a).chunk(replicas) for a in batch]
        optimizer.zero_grad()
        total = 0.0
        for r in range(replicas):
            with torch.nn.utils.stateless._reparametrize_module(model, buffers[r]):
                total = total + loss_fn(model, *(p[r] for p in parts))
        loss = total / replicas
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return model, buffers, losses
