from setuptools import setup

# kernels/ and integrations/ are top-level folders but live under graphpool's namespace: a top-level
# `kernels` package would clash with an unrelated PyPI package of that name.
setup(
    name="graphpool",
    version="0.1.0",
    description="CUDA graphs for several LLM step shapes (decode, speculative verify) over one memory pool",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["graphpool", "graphpool.kernels", "graphpool.integrations", "graphpool.integrations.sglang"],
    package_dir={"graphpool": "graphpool", "graphpool.kernels": "kernels",
                 "graphpool.integrations": "integrations"},
    package_data={"graphpool": ["csrc/*.cpp"]},
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton>=3.0"],
        "dev": ["pytest", "numpy", "matplotlib"],
        "sglang": ["sglang==0.5.12.post1"],
    },
)
