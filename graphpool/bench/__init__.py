"""graphpool's replay-latency microbenchmark, installed with the package: what each way of feeding a CUDA
graph costs per step, for every (mode, batch size) of a step, beside the bare replay (the floor) and
SGLang-style staging.

From a shell: ``graphpool-bench`` or ``python -m graphpool.bench`` (``--help``: the options; ``--step
module:factory`` times your own step). From Python::

    from graphpool.bench import BenchStep, benchmark
    step = BenchStep(inputs=[...your StepInputs...], step_fn=my_step, sample=my_sampler, outputs="token")
    result = benchmark(step, modes=[gp.Mode("decode", 1), gp.Mode("verify", 4)], batch_sizes=[1, 2, 4, 8],
                       device="cuda", iters=200, warmup=20)
    print(summary(result.rows, result.modes, result.sizes, result.cuda, result.env["misses"]))

A :class:`BenchStep` is what your pool is built from: the declared inputs, the step function, a sampler of real
inputs (``sample(mode, bs) -> {name: tensor}``) and the output rule. The integrations give you theirs:
``graphpool.bench.step.make_sglang`` (SGLang's runner inputs) and, for a Hugging Face model,
``graphpool.integrations.transformers``'s step (``--step transformers``).
"""
from .cli import main
from .replay import BenchResult, benchmark
from .report import summary
from .step import BenchStep, StepSpecError
from .step import make as default_step

__all__ = ["BenchStep", "BenchResult", "StepSpecError", "benchmark", "default_step", "summary", "main"]
