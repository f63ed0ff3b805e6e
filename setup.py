import os

from setuptools import setup

# kernels/ and integrations/ are top-level folders but live under graphpool's namespace: a top-level
# `kernels` package would clash with an unrelated PyPI package of that name.
#
# Versions: torch itself is installed first, by quickstart.sh (README.md), because which build pip picks
# depends on the machine (CPU: torch 2.13.0 from PyTorch's CPU wheels, as CI; CUDA: torch 2.11.0, the one
# SGLang 0.5.12.post1 pins). A looser `torch` requirement resolved here would pull a multi-GB CUDA build
# onto a CPU machine, so install_requires only states the floor.
SGLANG = "sglang==0.5.12.post1"
# SGLang's light dependencies: with `pip install --no-deps sglang==0.5.12.post1` installed after them, its
# Python classes import on a CPU machine (the tests drive the real classes). .ci/run installs them.
SGLANG_CLASSES = [
    "orjson==3.13.0", "psutil==7.2.2", "pybase64==1.5.1", "pillow==13.0.0", "starlette==1.10.0",
    "msgspec==0.23.0", "pydantic==2.14.4", "pyzmq==27.3.0", "ipython==9.18.1", "tqdm==4.70.1",
    "aiohttp==3.14.5", "transformers==5.6.0", "dill==0.4.1", "sentencepiece==0.2.1", "apache-tvm-ffi==0.1.9",
    "einops==0.8.2", "compressed-tensors==0.18.0", "gguf==0.19.0", "openai==2.6.1",
    "partial-json-parser==0.2.1.1.post7", "setproctitle==1.3.8", "uvicorn==0.54.0", "fastapi==0.165.0",
]

setup(
    name="graphpool",
    version="0.1.0",
    description="CUDA graphs for several LLM step shapes (decode, speculative verify) over one memory pool",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["graphpool", "graphpool.bench", "graphpool.kernels", "graphpool.integrations",
              "graphpool.integrations.sglang", "graphpool.integrations.transformers"],
    package_dir={"graphpool": "graphpool", "graphpool.kernels": "kernels",
                 "graphpool.integrations": "integrations"},
    package_data={"graphpool": ["csrc/*.cpp"]},
    install_requires=["torch>=2.4"],
    entry_points={"console_scripts": ["graphpool-bench = graphpool.bench.cli:main"]},
    extras_require={
        # Triton stages inputs inside the graph on CUDA (CUDA builds of torch bring it) and runs the
        # staging kernel in its interpreter in the CPU tests; CI pins 3.6.0 (quickstart.sh).
        "triton": ["triton>=3.0"],
        # The tests, the benchmarks' plots, and ninja for the C++ input checker's JIT build.
        "dev": ["pytest>=8", "pytest-timeout", "numpy", "matplotlib", "ninja"],
        # graphpool-bench's plot (and the eager Triton staging method's row table).
        "bench": ["numpy", "matplotlib"],
        # A real SGLang server (CUDA machine): `pip install -e ".[sglang]"`.
        "sglang": [SGLANG],
        # CI (CPU): SGLang's classes without its CUDA stack; then `pip install --no-deps sglang==0.5.12.post1`.
        "sglang-classes": SGLANG_CLASSES,
        # graphpool.integrations.transformers: the releases it supports (integrations/transformers/versions.py).
        "transformers": ["transformers>=5.6,<5.25"],
    },
)
