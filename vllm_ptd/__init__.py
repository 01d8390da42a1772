"""vllm-ptd: per-request tree speculative decoding (PTD, PCTree) for vLLM.

Importing the package is cheap: vLLM is touched only by ``vllm_ptd.plugin`` and the
``vllm_ptd.integration`` sub-package.
"""
__version__ = "0.1.0"
