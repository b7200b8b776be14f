from setuptools import find_packages, setup

setup(
    name="maxbridge",
    version="0.1.0",
    description="One transformer in Flax Linen and Flax NNX behind one config.",
    python_requires=">=3.11",
    packages=find_packages(include=["maxbridge*", "linen_models*", "nnx_models*", "converters*"]),
    package_data={"maxbridge": ["configs/*.yml", "configs/models/*.yml"]},
    # Pinned to the set the parity tests were run against: Flax's NNX and
    # bridge APIs still move between minor releases.
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "chex==0.1.92",
        "absl-py>=2.1",
        "pyyaml>=6",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "safetensors==0.8.0",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            # Reference implementations for tests/test_hf.py (the CPU build of torch).
            "torch==2.13.0",
            "transformers==5.23.0",
            "tokenizers==0.23.3",
        ],
    },
    entry_points={"console_scripts": ["maxbridge=maxbridge.cli:main"]},
)
