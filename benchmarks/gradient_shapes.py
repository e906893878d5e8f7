"""Parameter (gradient) tensor shapes of well-known models, layer by layer."""

from __future__ import annotations

Shapes = list[tuple[int, ...]]


def resnet50() -> Shapes:
    """161 tensors, 25.6M parameters: convolutions with batch-norm scale and offset."""
    shapes: Shapes = [(7, 7, 3, 64), (64,), (64,)]
    cin = 64
    for blocks, width in zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True):
        for block in range(blocks):
            for kernel, cout in ((1, width), (3, width), (1, 4 * width)):
                shapes += [(kernel, kernel, cin if kernel == 1 and cout == width else width, cout)]
                shapes += [(cout,), (cout,)]
            if block == 0:
                shapes += [(1, 1, cin, 4 * width), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(2048, 1000), (1000,)]


def bert(hidden: int = 768, layers: int = 12) -> Shapes:
    """BERT-base (199 tensors) by default; bert(1024, 24) is BERT-large (391, 335M)."""
    h = hidden
    attention = [(h, h), (h,)] * 4  # query, key, value, output: kernel and bias
    norm = [(h,), (h,)]
    mlp = [(h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    layer = attention + norm + mlp + norm
    return [(30522, h), (512, h), (2, h), *norm] + layer * layers + [(h, h), (h,)]


def gpt2(hidden: int = 768, layers: int = 12) -> Shapes:
    """GPT-2 small (148 tensors) by default; gpt2(1024, 24) is GPT-2 medium (292, 355M)."""
    h = hidden
    norm = [(h,), (h,)]
    attention = [(h, 3 * h), (3 * h,), (h, h), (h,)]
    mlp = [(h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    layer = norm + attention + norm + mlp
    return [(50257, h), (1024, h)] + layer * layers + norm


def llama2_7b() -> Shapes:
    """291 tensors, 6.74B parameters (trained in bf16)."""
    h, ffn = 4096, 11008
    layer = [(h, h)] * 4 + [(h, ffn), (h, ffn), (ffn, h)] + [(h,), (h,)]
    return [(32000, h)] + layer * 32 + [(h,), (32000, h)]
