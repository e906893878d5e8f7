"""The `xla-strategies` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _emulate_cpu_devices(count: int = 8) -> None:
    """Give the CPU backend `count` devices, so multi-replica code runs without accelerators.
    It only affects the CPU platform; a machine with GPUs or TPUs still uses those."""
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xla-strategies", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a transformer LM with MirroredStrategy")
    from xla_strategies.demo import train

    train.add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        _emulate_cpu_devices()
        train.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
