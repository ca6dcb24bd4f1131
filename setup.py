from setuptools import find_packages, setup

setup(
    name="megatron_glm5",
    version="0.1.0",
    description="GLM-5.3-Flash (Glm5NextForConditionalGeneration) training on megatron-core: TP/SP, PP/VPP, EP, CP, DP",
    packages=find_packages(include=["megatron_glm5", "megatron_glm5.*"]),
    package_data={"megatron_glm5.training": ["flag_table.json"]},  # the flag table's snapshot
    python_requires=">=3.12",
    install_requires=[
        "torch==2.13.0",
        "torchvision==0.28.0",  # transformers' GLM-5.3 processor builds its video processor on it
        "megatron-core==0.19.2",
        "transformers==5.23.0",
        "safetensors",
        "tokenizers",
        "pillow",
        "sentencepiece",
        "tensorboard",
        "einops",
        "psutil",
        "numpy",
        "av==19.0.2",  # PyAV: decodes mp4 / webm videos for --dataset-type chat
        "megatron-energon==7.4.0",  # Energon datasets as a --dataset-type chat source
    ],
    extras_require={
        # flash-linear-attention is not in the environment for the tests: transformers routes Glm5Next's KDA to FLA's
        # Triton kernels whenever ``fla`` imports, which needs a GPU; scripts/run_tests.sh puts FLA on the test run's
        # path only (MEGATRON_GLM5_TEST_SITE), so the same environment still runs an exported model on CPU
        "test": ["pytest", "pytest-xdist", "ruff==0.17.6"],
        "gpu": ["flash-linear-attention==0.6.0", "fla-core==0.6.0", "triton"],
    },
)
