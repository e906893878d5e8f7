"""MaxText's own ahead-of-time compile of a Llama-2 train step for a TPU topology, its HLO
written out for our reader (`xla-strategies report`), so MaxText is measured the way ours
is.

MaxText installs in an environment of its own (its dependencies pin their own releases),
with this package beside it for `benchmarks/maxtext_models.py`:

    make .venv-maxtext/.installed-stamp     # tools/make-maxtext-venv, with Python 3.12
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python benchmarks/maxtext_aot.py maxtext.hlo.txt
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python benchmarks/maxtext_aot.py 70b.hlo.txt \\
        --model llama2-70b --topology v5p-512 ici_tensor_parallelism=4
    xla-strategies report maxtext.hlo.txt --topology v5e-256
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python benchmarks/maxtext_aot.py 2x.hlo.txt \\
        --topology 2xv5p-512                      # two slices: MaxText's num_slices=2

It prints MaxText's per-chip bytes (arguments + outputs - aliased + temporaries + code)
from the executable's memory analysis. Plain attention (`attention=dot_product`), one
sequence of 2048 tokens per chip, as `benchmarks.tpu_models`' Llama-2 steps; any other
MaxText setting is passed on as `key=value`.
"""

from __future__ import annotations

import argparse
import re

from absl import app
from maxtext.trainers.pre_train import train_compile

_compile = train_compile.jit_and_compile
_MULTISLICE = re.compile(r"^(\d+)x")  # 2xv5p-512: two v5p-512 slices


def _recording(out: str, label: str):  # noqa: ANN202
    def compile_and_record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        compiled = _compile(*args, **kwargs)
        with open(out, "w") as hlo:
            hlo.write(compiled.as_text())
        m = compiled.memory_analysis()
        total = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes
        )
        print(f"MaxText {label}: {total / 2**30:.2f} GiB per chip", flush=True)
        return compiled

    return compile_and_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hlo", help="where to write the compiled HLO text")
    parser.add_argument("--model", default="llama2-7b", help="MaxText's model_name")
    parser.add_argument(
        "--topology",
        default="v5e-256",
        help="MaxText's compile_topology; NxNAME for N slices of NAME (2xv5p-512)",
    )
    args, overrides = parser.parse_known_args()  # the rest: MaxText settings, key=value
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        parser.error(f"MaxText settings are key=value, got {bad}")
    args.overrides = overrides
    label = f"{args.model} on {args.topology} {' '.join(args.overrides)}".strip()
    train_compile.jit_and_compile = _recording(args.hlo, label)
    base = train_compile.__file__.rsplit("/trainers/", 1)[0] + "/configs/base.yml"
    multislice = _MULTISLICE.match(args.topology)
    slices = multislice.group(1) if multislice else "1"
    one_slice = args.topology[multislice.end() :] if multislice else args.topology
    argv = ["train_compile", base, f"model_name={args.model}",
            f"compile_topology={one_slice}", f"compile_topology_num_slices={slices}",
            "per_device_batch_size=1", "max_target_length=2048", "attention=dot_product",
            "run_name=aot", *args.overrides]  # fmt: skip
    app.run(train_compile.main, argv=argv)


if __name__ == "__main__":
    main()
