from setuptools import find_packages, setup

# `maxbridge serve` (maxbridge/serving/server.py): the ASGI stack, chat templates, Prometheus metrics.
# `maxbridge compile compile_topology=v5p-8`: libtpu, the TPU compiler, at the version this jax pins (jax's extra).
TPU = ["jax[tpu]>=0.10.2"]
SERVE = ["fastapi>=0.165.0", "uvicorn>=0.54.0", "jinja2>=3.1.6", "prometheus_client>=0.26.0"]

setup(
    name="maxbridge",
    version="0.1.0",
    description="One transformer in Flax Linen and Flax NNX behind one config.",
    python_requires=">=3.11",
    packages=find_packages(include=["maxbridge*", "linen_models*", "nnx_models*", "converters*"]),
    package_data={"maxbridge": ["configs/*.yml", "configs/models/*.yml"]},
    # Ranges, not pins, so that maxbridge installs beside MaxText. Each lower
    # bound is the oldest set CI tests (constraints.txt, Python 3.11); CI also
    # tests the newest releases on Python 3.12 (.ci/run). No upper bounds: none
    # of the newest releases is known to break us.
    install_requires=[
        "jax>=0.10.2",
        "jaxlib>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "absl-py>=2.5.1",
        "pyyaml>=6.0.3",
        "numpy>=2.4.6",
        "matplotlib>=3.11.2",
        "tqdm>=4.70.1",
        "safetensors>=0.8.0",
        # Stacks that orbax stores as one chunk are decoded as a stream (converters/source.py):
        # tensorstore decodes a chunk only whole, at 4x its size in memory.
        "zstandard>=0.25.0",
        # A digest of every saved array (maxbridge/core/checkpointing.py), checked on restore, compare and verify.
        "xxhash>=4.1.0",
        # Data larger than memory (maxbridge/training/grain_data.py): Grain's pipelines and orbax handler,
        # ArrayRecord and Parquet/Arrow files.
        "grain>=0.2.18",
        "array-record>=0.8.6",
        "pyarrow>=26.0.1",
        # A Hugging Face tokenizer.json for pre-training, SFT and DPO text (tokenizer_path).
        "tokenizers>=0.23.3",
        # Images for the vision towers (maxbridge/interop/images.py): decoded and resized as the families'
        # Hugging Face image processors do, without transformers at run time.
        "pillow>=13.0.0",
        # Quantization (maxbridge/quantization.py): AQT and Qwix.
        "aqtp>=0.9.0",
        "qwix>=0.1.8",
    ],
    extras_require={
        "test": [
            "pytest>=9.2.0",
            "pytest-xdist>=3.8.0",
            # Reference implementations for tests/test_hf.py (the CPU build of torch).
            "torch>=2.13.0",
            "transformers>=5.23.0",
            # tests/test_serve.py talks to `maxbridge serve` as a user would, with the official client.
            "openai>=3.57.0",
            # tests/test_eval_harness.py scores a task through `maxbridge serve` as evaluators do.
            "lm-eval[api]>=0.4.13",
            # tests/test_topology.py compiles for TPU topologies on this host, as users check a fit.
            *TPU,
            *SERVE,
        ],
        "serve": SERVE,
        "tpu": TPU,
        # `make lint` / `make format`; exact, so formatting never drifts between machines.
        # import-linter: the layer contracts in pyproject.toml (see ARCHITECTURE.md).
        "dev": ["pyink==26.5.1", "ruff==0.17.6", "import-linter==2.17"],
    },
    entry_points={"console_scripts": ["maxbridge=maxbridge.cli:main"]},
)
