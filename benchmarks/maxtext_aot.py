"""MaxText's own ahead-of-time compile of Llama-2-7B for v5e-256, its HLO written out for
our reader (`xla-strategies report`), so MaxText is measured the way ours is.

MaxText installs in an environment of its own (its dependencies pin their own releases):

    python3.12 -m venv .venv-maxtext && .venv-maxtext/bin/pip install \\
        "maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0.1" "jaxlib==0.12.0.1"
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python benchmarks/maxtext_aot.py maxtext.hlo.txt
    xla-strategies report maxtext.hlo.txt --topology v5e-256

It prints MaxText's per-chip bytes (arguments + outputs - aliased + temporaries + code)
from the executable's memory analysis; plain attention (`attention=dot_product`), one
sequence of 2048 tokens per chip, as `benchmarks.tpu_models`' Llama-2-7B step.
"""

from __future__ import annotations

import sys

from absl import app
from maxtext.trainers.pre_train import train_compile

_compile = train_compile.jit_and_compile


def _recording(*args, **kwargs):
    compiled = _compile(*args, **kwargs)
    with open(sys.argv[1], "w") as out:
        out.write(compiled.as_text())
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    print(f"MaxText Llama-2-7B on v5e-256: {total / 2**30:.2f} GiB per chip", flush=True)
    return compiled


def main() -> None:
    train_compile.jit_and_compile = _recording
    base = train_compile.__file__.rsplit("/trainers/", 1)[0] + "/configs/base.yml"
    argv = ["train_compile", base, "model_name=llama2-7b", "compile_topology=v5e-256",
            "compile_topology_num_slices=1", "per_device_batch_size=1",
            "max_target_length=2048", "attention=dot_product", "run_name=aot"]  # fmt: skip
    app.run(train_compile.main, argv=argv)


if __name__ == "__main__":
    main()
