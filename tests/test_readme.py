"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def test_readme_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["strategy"].num_replicas_in_sync == 8
    loss = float(namespace["loss"])
    assert np.isfinite(loss) and loss < 1.0  # ten Adam steps from w = 0, where the loss is 1
