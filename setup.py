"""moe_plugin: hybrid expert parallelism for Megatron-Core GPT training on the DeepSpeed engine."""
from setuptools import find_packages, setup

# Ranges are the ones the test suite has been run with. torch: CI runs 2.13 (the CPU build on this machine's
# disk); `make test-fast` passed on both bounds by hand, 2.11.0+cu130 (Python 3.12) and 2.15.0+cu132 (Python
# 3.11), PyPI's CUDA builds run on the CPU (docs/training.md, "Which torch").
INSTALL_REQUIRES = [
    "torch>=2.11,<2.16",
    "deepspeed>=0.19.8,<0.20",
    "megatron-core>=0.16.1,<0.17",
    "numpy>=2.0,<3",
    "pydantic>=2.10,<3",
    "hjson>=3,<4",          # DeepSpeed JSON files are read as DeepSpeed reads them (comments, duplicate keys)
    "safetensors>=0.4,<1",  # moe-plugin export
]

EXTRAS_REQUIRE = {
    "test": ["pytest>=8,<10", "tensorboard>=2.14,<3", "matplotlib>=3.8,<4"],
    # the example's metrics.png, moe-plugin report and plan's plots (without it: no plot, said in one line)
    "plots": ["matplotlib>=3.8,<4"],
    # DeepSpeed's tensorboard monitor backend ("tensorboard": {"enabled": true} in the JSON)
    "tensorboard": ["tensorboard>=2.14,<3"],
    # apex is optional: fused kernels are used when it is importable, torch fallbacks otherwise.
    # It is not on the package index under that name; install it from NVIDIA's sources.
    "apex": [],
    # moe-plugin import-hf / export-hf / preprocess --tokenizer: Hugging Face models and tokenizers
    "hf": ["transformers>=5.0,<6", "tokenizers>=0.20,<1", "jinja2>=3.1"],   # jinja2: chat templates
}

setup(
    name="moe_plugin",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11",
    packages=find_packages(include=["moe_plugin", "moe_plugin.*", "moe_plugin_tools", "moe_plugin_tools.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["moe-plugin=moe_plugin_tools.cli:main"]},
)
