"""What the benchmark times: a step (its declared inputs, the step function, a sampler of real inputs and
the output rule), given as a :class:`BenchStep`, and the steps it knows by name.

* ``default``: the embedded step, a small transformer-style decode step over SGLang's decode inputs. Six
  inputs, int64 and int32, as SGLang's runner stages them for a decode or verify step: ``input_ids``,
  ``positions``, ``out_cache_loc`` (int64, per token), ``out_cache_loc_swa`` (int32, per token; SGLang's
  sliding-window cache location), ``seq_lens`` (int32, per sequence) and ``req_pool_indices`` (int64, per
  sequence). It embeds the tokens, writes a KV stand-in at ``out_cache_loc``, attends over a fixed window of
  each request's cached rows masked by ``seq_lens``, and returns logits and greedy tokens.
* ``sglang``: the same model over the inputs graphpool's SGLang runners declare
  (``graphpool.integrations.sglang``; needs SGLang's Python classes).
* ``transformers``: a small Llama (random weights) through graphpool's transformers integration (its slot
  cache, declarations, step function and output rule; needs transformers).
* Your own: a factory ``factory(device, max_tokens) -> BenchStep``, named ``module:factory``.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import graphpool as gp

STEP_CONTRACT = ("expected a built-in step (default, sglang, transformers) or module:factory, factory(device, "
                 "max_tokens) -> BenchStep")


class StepSpecError(ValueError):
    """A ``--step`` that names no usable step factory; the message says what was expected."""


@dataclass
class BenchStep:
    """What the benchmark needs of a step.

    Attributes:
        inputs: the declared inputs (the pool's ``StepInput`` list).
        step_fn: the step function, ``step_fn(batch) -> outputs`` (as for :meth:`GraphPool.capture`).
        sample: ``sample(mode, bs) -> {name: tensor}``, one step's real inputs of ``bs`` sequences.
        outputs: the output rule (``capture(..., outputs=...)``): which outputs have rows.
        check: the name of one output (a tensor) compared with the eager step's on each key, ``None`` for none.
    """

    inputs: list[gp.StepInput]
    step_fn: Callable[[gp.StepBatch], Any]
    sample: Callable[[gp.Mode, int], dict[str, torch.Tensor]]
    outputs: Any = None
    check: Optional[str] = None


def make(device: torch.device, max_tokens: int, hidden: int = 512, vocab: int = 8192, window: int = 64,
         layers: int = 2, dtype: torch.dtype | None = None, inputs: list[gp.StepInput] | None = None) -> BenchStep:
    """The default step, sized for ``max_tokens`` token rows per step (bf16 on CUDA, else float32). ``inputs``
    replaces its declarations (same names; the SGLang step drops ``out_cache_loc_swa``)."""
    g = torch.Generator().manual_seed(0)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    def param(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device, dtype)

    num_slots = max_tokens * 2 + window + 1   # slot 0 is the dummy slot padded rows write to
    max_reqs = 512
    embed, lm_head = param(vocab, hidden), param(hidden, vocab)
    weights = [(param(hidden, 3 * hidden), param(hidden, hidden)) for _ in range(layers)]
    kv = torch.zeros(layers, num_slots, hidden, dtype=dtype, device=device)
    swa = torch.zeros(num_slots, dtype=dtype, device=device)
    req_to_token = torch.randint(1, num_slots, (max_reqs, window), generator=g).to(device)
    inputs = inputs or [
        gp.StepInput("input_ids", torch.int64, "token", fill=0),
        gp.StepInput("positions", torch.int64, "token", fill=0),
        gp.StepInput("out_cache_loc", torch.int64, "token", fill=0),
        gp.StepInput("out_cache_loc_swa", torch.int32, "token", fill=0),
        gp.StepInput("seq_lens", torch.int32, "seq", fill=1),
        gp.StepInput("req_pool_indices", torch.int64, "seq", fill=0),
    ]
    names = {s.name for s in inputs}
    seq_dtype = next(s.dtype for s in inputs if s.name == "seq_lens")
    cols = torch.arange(window, device=device)

    def step(batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        x, tps = batch.inputs, batch.mode.tokens_per_seq
        h = embed[x["input_ids"]] * (1.0 + (x["positions"] % 7).to(dtype)[:, None] * 0.01)
        visible = (cols[None, :] < x["seq_lens"][:, None]).repeat_interleave(tps, 0)        # [T, W]
        rows = req_to_token[x["req_pool_indices"]].repeat_interleave(tps, 0)                 # [T, W]
        for layer, (w_qkv, w_o) in enumerate(weights):
            q, k, v = (torch.nn.functional.rms_norm(h, (hidden,)) @ w_qkv).chunk(3, dim=-1)
            kv[layer].index_copy_(0, x["out_cache_loc"], k)
            keys = kv[layer][rows]                                                            # [T, W, H]
            scores = (keys @ q[:, :, None]).squeeze(-1).float().masked_fill(~visible, -1e9)
            h = h + (torch.softmax(scores, -1).to(dtype)[:, :, None] * keys).sum(1) @ w_o + v
        if "out_cache_loc_swa" in x:
            swa.index_copy_(0, x["out_cache_loc_swa"].long(), h[:, 0])
        logits = h @ lm_head
        return {"logits": logits, "next_tokens": logits.argmax(-1)}

    def sample(mode: gp.Mode, bs: int) -> dict[str, torch.Tensor]:
        tokens = bs * mode.tokens_per_seq
        loc = torch.randperm(num_slots - 1, device=device)[:tokens] + 1
        real = {
            "input_ids": torch.randint(0, vocab, (tokens,), device=device),
            "positions": torch.randint(0, 4096, (tokens,), device=device),
            "out_cache_loc": loc,
            "out_cache_loc_swa": loc.to(torch.int32),
            "seq_lens": torch.randint(1, window + 1, (bs,), device=device, dtype=seq_dtype),
            "req_pool_indices": torch.randint(0, max_reqs, (bs,), device=device),
        }
        return {k: v for k, v in real.items() if k in names}

    # logits and next_tokens: one row per token; next_tokens is compared with the eager step's
    return BenchStep(inputs, step, sample, outputs="token", check="next_tokens")


def make_sglang(device: torch.device, max_tokens: int) -> BenchStep:
    """The default model over the inputs graphpool's SGLang runners declare (their dtypes and fills)."""
    try:
        from graphpool.integrations.sglang import common
    except ImportError as exc:
        raise StepSpecError(f"--step sglang needs SGLang's Python classes ({exc}); install sglang, or use --step "
                            f"default") from None
    return make(device, max_tokens, inputs=common.step_inputs(seq_len_fill_value=1))


def make_transformers(device: torch.device, max_tokens: int, max_len: int = 256) -> BenchStep:
    """A small Llama (transformers, random weights; bf16 on CUDA) through graphpool's transformers integration:
    its :class:`~graphpool.integrations.transformers.SlotCache` (one slot per token row the step may carry),
    its input declarations, step function and output rule. Each sampled row sits at a random position of its
    own slot."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from graphpool.integrations.transformers import SlotCache, sampling, step as hf_step
    except ImportError as exc:
        raise StepSpecError(f"--step transformers needs transformers ({exc}); pip install transformers, or use "
                            f"--step default") from None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, dtype).eval().requires_grad_(False)
    cache = SlotCache(model, max_tokens + 1, max_len)
    forward = hf_step.SlotForward(model, cache)

    def step_fn(batch: gp.StepBatch) -> Any:
        with torch.no_grad():  # the model's weights and cache stay out of autograd
            return forward(batch)

    def sample(mode: gp.Mode, bs: int) -> dict[str, torch.Tensor]:
        width = mode.tokens_per_seq
        starts = torch.randint(0, max_len - width + 1, (bs, 1))
        return {"input_ids": torch.randint(0, config.vocab_size, (bs * width,), device=device),
                "positions": (starts + torch.arange(width)).view(-1).to(device),
                "slots": torch.arange(1, bs + 1, device=device),
                "sampling": torch.tensor([sampling.NEUTRAL] * bs, dtype=torch.float32, device=device),  # greedy
                "uniforms": torch.rand(bs * width, 2, device=device)}

    return BenchStep(hf_step.step_inputs(cache, config.vocab_size), step_fn, sample, outputs=hf_step.STEP_OUTPUTS,
                     check="out")


BUILT_IN: dict[str, Callable[..., BenchStep]] = {"default": make, "sglang": make_sglang,
                                                 "transformers": make_transformers}


def load_factory(spec: str | None) -> Callable[..., BenchStep]:
    """The step factory ``spec`` names: a built-in name (:data:`BUILT_IN`; ``None`` is ``default``) or
    ``module:factory`` (``module`` looked up first in the current working directory, then on Python's path;
    ``module:Class.method`` names a factory inside a class). Checked before anything is built: the module
    imports, has the factory, and the factory takes ``(device, max_tokens)``. An exception raised by the
    user's own module while it imports propagates with its traceback, with a note naming the step.

    Raises:
        StepSpecError: ``spec`` names no such factory (the message says what was expected).
    """
    if spec is None or spec in BUILT_IN:
        return BUILT_IN[spec or "default"]
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr or ":" in attr:
        raise StepSpecError(f"{spec}: not a built-in step or module:factory; {STEP_CONTRACT}")
    cwd = os.getcwd()
    if cwd not in sys.path:  # run as a script or with -m, Python's path may not hold the folder the user is in
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module written since this process last looked in that folder
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            exc.add_note(f"graphpool.bench: raised while importing the step {spec}")
            raise  # the module exists, something it imports does not: the traceback says where
        hint = " (name the module, not its file: drop the .py)" if module.endswith(".py") else ""
        raise StepSpecError(f"{spec}: no module named {exc.name!r} in the current directory ({cwd}) or on "
                            f"Python's path{hint}; {STEP_CONTRACT}") from None
    except Exception as exc:
        exc.add_note(f"graphpool.bench: raised while importing the step {spec}")
        raise
    factory: object = mod
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise StepSpecError(f"{spec}: module {module} ({getattr(mod, '__file__', '?')}) has no attribute "
                                f"{attr!r}; {STEP_CONTRACT}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise StepSpecError(f"{spec}: {module}.{attr} is a {type(factory).__name__}, not callable; {STEP_CONTRACT}")
    try:
        inspect.signature(factory).bind(torch.device("cpu"), 1)
    except TypeError as exc:
        raise StepSpecError(f"{spec}: {module}.{attr} cannot be called as factory(device, max_tokens) ({exc}); "
                            f"{STEP_CONTRACT}") from None
    except ValueError:
        pass  # a builtin without a signature: the call itself will tell
    return factory  # type: ignore[return-value]


def build_step(factory: Callable[..., BenchStep], spec: str | None, device: torch.device, max_tokens: int) -> BenchStep:
    """Call the step factory and check what it returned (an exception inside it propagates, noted).

    Raises:
        StepSpecError: the factory returned something without ``inputs``, ``step_fn`` and ``sample``.
    """
    try:
        step = factory(device, max_tokens)
    except Exception as exc:
        exc.add_note(f"graphpool.bench: raised by the step factory {spec or 'default'}")
        raise
    check_step(step)
    return step


def check_step(step: Any) -> None:
    """Refuse a step without the parts a benchmark uses: a list of ``StepInput``, and callables."""
    if not all(hasattr(step, name) for name in ("inputs", "step_fn", "sample")):
        raise StepSpecError(f"the step factory returned a value of type {type(step).__name__}, not a BenchStep "
                            f"(inputs, step_fn, sample); {STEP_CONTRACT}")
    if not step.inputs or not all(isinstance(s, gp.StepInput) for s in step.inputs):
        raise StepSpecError(f"the step's inputs must be a non-empty list of graphpool.StepInput, got {step.inputs!r}")
    for name in ("step_fn", "sample"):
        if not callable(getattr(step, name)):
            raise StepSpecError(f"the step's {name} must be callable, got {type(getattr(step, name)).__name__}")


def sample_checked(step: BenchStep, mode: gp.Mode, bs: int) -> dict[str, torch.Tensor]:
    """``step.sample(mode, bs)``, refused with a message naming the sampler when it returns something else
    than a dict of tensors for the declared inputs."""
    inputs = step.sample(mode, bs)
    names = [s.name for s in step.inputs]
    if not isinstance(inputs, dict) or sorted(inputs) != sorted(names) or not all(
            isinstance(t, torch.Tensor) for t in inputs.values()):
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise StepSpecError(f"the step's sample(mode, bs) must return a dict of tensors keyed by the declared inputs "
                            f"{names}; for mode {mode.name!r} bs {bs} it returned {got}")
    return inputs
