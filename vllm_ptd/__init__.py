"""vllm-ptd: per-request tree speculative decoding (PTD, PCTree) for vLLM.

Importing the package is cheap: vLLM is touched only by ``vllm_ptd.plugin`` and the
``vllm_ptd.integration`` sub-package.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

# The plugin's log lines (patches applied, drafting warmed up, the periodic per-step summary)
# go through vLLM's own logging: a child of vLLM's "vllm" logger takes its handler, format
# and VLLM_LOGGING_LEVEL in every engine process, where a logger of its own had no handler
# and dropped every line below a warning.
LOGGER_NAME = "vllm.vllm_ptd"

# The Triton kernels live in the repository's top-level ``kernels/`` folder and are installed
# as ``vllm_ptd.kernels`` (setup.py's package_dir). Wheels and PEP 660 editable installs map
# the name themselves; a legacy ``setup.py develop`` install (an egg-link: the repository
# root on sys.path) and a plain source checkout do not, so there the name is mapped here.
_TOP_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


class _TopLevelKernelsFinder(importlib.abc.MetaPathFinder):
    """Finds ``vllm_ptd.kernels`` in the checkout's ``kernels/`` folder (its submodules are
    then found through the package's ``__path__`` as usual)."""

    def find_spec(self, name, path=None, target=None):
        if name != "vllm_ptd.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, _TOP_KERNELS / "__init__.py", submodule_search_locations=[str(_TOP_KERNELS)])


def _map_top_level_kernels() -> None:
    if (Path(__file__).resolve().parent / "kernels").is_dir():
        return  # installed as a wheel: the sub-package is here
    if not (_TOP_KERNELS / "__init__.py").is_file():
        return
    if any(isinstance(f, _TopLevelKernelsFinder) for f in sys.meta_path):
        return
    # after the other finders: an editable install's own mapping wins when there is one
    sys.meta_path.append(_TopLevelKernelsFinder())


_map_top_level_kernels()
