"""examples/torch_cnn.py trains as written and its weights work back in eager torch."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import run_example


def test_the_torch_example_learns_and_hands_its_weights_back_to_the_module():
    stdout = run_example("torch_cnn.py", "--steps", "30")
    accuracy = float(stdout.strip().split("test accuracy ")[-1])
    assert accuracy > 0.8, stdout  # chance is 0.25


def test_without_the_extra_the_import_error_names_it():
    code = (
        "import sys; sys.modules['torchax'] = None\n"
        "try:\n    import xla_strategies.torch\n"
        "except ImportError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'xla-strategies[torch]'" in done.stdout, done.stderr[-2000:]
