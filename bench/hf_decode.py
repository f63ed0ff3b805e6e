"""Hugging Face transformers decode: graphpool's loop against transformers' own paths, one process.

A model of a realistic size from its public config (default: Llama-3.2-1B's values, random weights, bf16),
batch sizes 1..32, the same prompts and the same number of new tokens per row (no EOS), tokens/s of:

  (a) hf-eager    ``model.generate()`` eager, its dynamic cache
  (b) hf-static   ``model.generate(cache_implementation="static")``: on CUDA transformers compiles the decode
                  step with ``torch.compile(mode="reduce-overhead")`` (its defaults: CUDA graphs, dynamic shapes
                  after the second shape); compile time reported, batch sizes capped by ``--compile-budget-s``
  (c) hf-lookup   ``model.generate(prompt_lookup_num_tokens=k)``, batch 1 only (transformers refuses more)
  (d) gp-plain    graphpool.integrations.transformers.PoolGenerator, plain decode, every step a CUDA graph
  (e) gp-lookup   the same pool, plain + prompt lookup (SpeculationPolicy + AcceptanceGate), batched

and with ``--tiers`` (speculation tiers, docs/tiers.md), after the table's variants:

  (f) gp-tiers    the same pool with a verify mode per tier's draft length: a TierSchedule picks each step's
                  draft length by batch size (plain decode above the last bound); steps per tier reported

graphpool's step is the model's own eager modules inside the graph; with ``--compile`` the model's forward is compiled
first (``torch.compile``'s defaults, no CUDA graphs of its own; the sampler stays eager) and the pool captures the
compiled kernels. With ``--sample`` every variant samples (Llama-3.2-1B's own settings: temperature 0.6, top-p 0.9;
prompt lookup by exact speculative sampling); tokens are then compared by nothing but their count. Also: the
pool's capture time, the acceptance per verify step, a graphed verify step's GPU time against a graphed plain
step's at batch 1, and whether (d)'s and (e)'s tokens equal (a)'s. The prompts repeat spans (a code block
edited, a document quoted by its summary), and random greedy models repeat their own output: lookup finds drafts.

    python bench/hf_decode.py                        # the H200 run (about 5 minutes; writes out/hf_decode.*)
    python bench/hf_decode.py --smoke                # a tiny model on CPU in seconds: the code path, no timing
    python bench/hf_decode.py --tiers 4:2,2:8,1:16   # + (f): 4 drafts up to bs 2, 2 up to 8, 1 up to 16, plain above
    python bench/hf_decode.py --sample --compile     # sampled, graphpool's step compiled before its capture

Writes ``<out>.json``, ``<out>.csv`` and ``<out>.png`` all or none (graphpool.bench.outputs) and prints a short table
last, with the issue's goals as PASS/FAIL lines (not judged on a smoke run).
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import graphpool as gp  # noqa: E402
from bench.hf_report import Run, check_goals, table, write_outputs  # noqa: E402
from graphpool.bench.outputs import OutputError, OutputSet  # noqa: E402

log = logging.getLogger("hf_decode")

#: (b)'s compile estimates: the first (16 layers, reduce-overhead) before any was seen, about 2.5x the 14-16 s
#: measured (runs BI, BV; 90 s skipped (b) at every size in run BT with 101 s left); a compile after two that took
#: long (torch.compile's second shape makes the batch dynamic, and later shapes seldom recompile); and the seconds
#: kept before the deadline for the files and the table.
FIRST_COMPILE_S, DYNAMIC_COMPILE_S, RESERVE_S = 40.0, 15.0, 25.0

#: Llama-3.2-1B's public config values (random weights here; no download). EOS off: every row makes N tokens.
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
                   rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                   bos_token_id=128000, eos_token_id=None, pad_token_id=None)
#: The smoke run's model: Llama's layout, tiny.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on CPU, batch sizes 1,2,4: the code path in seconds")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (no EOS)")
    p.add_argument("--draft-tokens", type=int, default=4, help="prompt-lookup drafts per verify step, (c) and (e)")
    p.add_argument("--tiers", default="",
                   help="(f): speculation tiers as DRAFTS:OFF_ABOVE[/ON_AT_OR_BELOW], longest draft first, at most "
                        "--draft-tokens drafts each, e.g. 4:2,2:8,1:16 (plain decode above the last bound)")
    p.add_argument("--prompt-len", default="96,192", help="prompt lengths, min,max")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point after one warm-up run (median)")
    p.add_argument("--compile-budget-s", type=float, default=240.0,
                   help="seconds (b) may spend compiling; batch sizes past it are skipped and listed")
    p.add_argument("--deadline-s", type=float, default=320.0,
                   help="the whole run's time limit: (b) starts no compile that would end past it (estimated from "
                        "the last one), so the files are written inside one device call")
    p.add_argument("--sample", action="store_true",
                   help="every variant samples (temperature 0.6, top-p 0.9: Llama-3.2-1B's generation config)")
    p.add_argument("--compile", action="store_true",
                   help="graphpool's model forward compiled with torch.compile (no CUDA graphs of its own) before its "
                        "capture")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (smoke default)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "out" / "hf_decode"), help="output prefix: .json, .csv, .png")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    if args.smoke:
        args.device, args.batch_sizes = args.device or "cpu", [b for b in args.batch_sizes if b <= 4] or [1]
        args.new_tokens, args.prompt_len, args.repeats = min(args.new_tokens, 16), (12, 40), 1
        args.draft_tokens = min(args.draft_tokens, 3)
    args.tiers = parse_tiers(p, args.tiers, args.draft_tokens)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    #: generate()'s token choice, for every variant
    args.choice = dict(do_sample=True, temperature=0.6, top_p=0.9) if args.sample else dict(do_sample=False)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    return args


def parse_tiers(p: argparse.ArgumentParser, text: str, draft_tokens: int) -> list[tuple[int, ...]]:
    """``--tiers`` as ``(drafts, off_above[, on_at_or_below])`` per tier, checked as (f)'s generator will check
    them (order, bounds, hysteresis): refused here, before any work."""
    tiers = []
    for item in filter(None, text.split(",")):
        drafts, _, bounds = item.partition(":")
        try:
            tier = (int(drafts), *(int(b) for b in bounds.split("/")))
        except ValueError:
            tier = ()
        if len(tier) not in (2, 3):
            p.error(f"--tiers: {item!r} is not DRAFTS:OFF_ABOVE[/ON_AT_OR_BELOW], e.g. 4:2 or 2:8/6")
        if not 1 <= tier[0] <= draft_tokens:
            p.error(f"--tiers: {item!r} drafts {tier[0]} tokens; each tier drafts 1 to --draft-tokens ({draft_tokens}, "
                    f"at most 3 with --smoke) tokens: raise --draft-tokens or shorten the tier")
        tiers.append(tier)
    if tiers:
        from graphpool.integrations.transformers import draft_schedule, step_modes
        modes = {m.name: m for m in step_modes(tier_lengths(draft_tokens, tiers))}
        try:
            draft_schedule(modes, tiers)
        except ValueError as exc:
            p.error(f"--tiers: {exc}")
    return tiers


def tier_lengths(draft_tokens: int, tiers: list[tuple[int, ...]]) -> list[int]:
    """The generator's draft lengths with ``--tiers``: ``--draft-tokens`` (``verify``, (e)'s) and each tier's."""
    return sorted({draft_tokens, *(t[0] for t in tiers)}, reverse=True)


# ---------------------------------------------------------------------------------------------- inputs
def make_prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """Prompts with repeated spans: even ones a code block, an instruction, the block again with a few tokens
    edited; odd ones a document, then a summary quoting two of its spans. Lengths spread over ``lengths``."""
    rng = random.Random(seed)
    low = min(1000, vocab // 4)  # away from special tokens

    def words(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    prompts = []
    for i in range(count):
        total = lengths[0] + (lengths[1] - lengths[0]) * i // max(count - 1, 1)
        if i % 2 == 0:
            block = words(max((total - 6) // 2, 2))
            edited = [rng.randrange(low, vocab) if rng.random() < 0.08 else t for t in block]
            prompt = block + words(6) + edited
        else:
            doc = words(max(total * 2 // 3, 4))
            span = max(len(doc) // 6, 1)
            a, b = rng.randrange(len(doc) - span + 1), rng.randrange(len(doc) - span + 1)
            prompt = doc + words(3) + doc[a:a + span] + words(2) + doc[b:b + span]
        prompts.append(prompt[:total] if len(prompt) >= total else prompt + words(total - len(prompt)))
    return prompts


@dataclass
class Batch:
    """Prompts left-padded for ``generate`` (decoder-only batches pad on the left)."""

    prompts: list[list[int]]
    ids: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, prompts: list[list[int]], device: str) -> "Batch":
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return cls(prompts, ids, mask)


# ---------------------------------------------------------------------------------------------- runs
def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    synchronize(device)
    started = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - started


def measure(variant: str, bs: int, fn: Callable[[], Any], args: argparse.Namespace,
            tokens_of: Callable[[Any], list[list[int]]], extra: Callable[[Any], dict] | None = None) -> Run:
    """One warm-up call (its time is the compile time where there is one), then ``repeats`` timed ones."""
    try:
        out, first = timed(fn, args.device)
        times = []
        for _ in range(args.repeats):
            out, seconds = timed(fn, args.device)
            times.append(seconds)
    except Exception as exc:  # one failed point must not lose the others: recorded, reported
        log.exception("%s bs %d failed", variant, bs)
        return Run(variant, bs, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    seconds = statistics.median(times)
    tokens = tokens_of(out)
    run = Run(variant, bs, tokens_per_s=sum(map(len, tokens)) / seconds, seconds=seconds, first_call_s=first,
              tokens=tokens, **(extra(out) if extra else {}))
    print(f"hf_decode: {variant:<10} bs {bs:>3}: {run.tokens_per_s:9.1f} tok/s ({seconds * 1e3:.0f} ms per call, "
          f"first call {first:.2f} s)" + (f", {run.accept:.2f} tokens per verify step" if run.accept else ""),
          flush=True)
    return run


def hf_runs(model: torch.nn.Module, batches: dict[int, Batch], args: argparse.Namespace, variant: str,
            **generate_args) -> list[Run]:
    runs = []
    for bs, batch in batches.items():
        def call(batch=batch):
            return model.generate(input_ids=batch.ids, attention_mask=batch.mask, max_new_tokens=args.new_tokens,
                                  pad_token_id=0, **args.choice, **generate_args)
        width = batch.ids.shape[1]
        runs.append(measure(variant, bs, call, args, lambda out, w=width: out[:, w:].tolist()))
    return runs


def static_runs(model: torch.nn.Module, batches: dict[int, Batch], args: argparse.Namespace) -> list[Run]:
    """(b): transformers' static cache; on CUDA it compiles the decode step (reduce-overhead). Batch sizes in an
    order that covers both ends first; once ``--compile-budget-s`` is spent, the rest are skipped and listed."""
    order = sorted(batches, key=lambda b: (b not in (min(batches), max(batches)), b))
    runs, spent, estimate, compiles, failed = [], 0.0, FIRST_COMPILE_S, [], None
    for bs in order:
        left = args.deadline_s - (time.perf_counter() - args.started)
        if failed is not None:  # a compile that failed once fails again, after as long: spend nothing more on it
            runs.append(Run("hf-static", bs, error=f"skipped: (b) failed at bs {failed}"))
            continue
        if spent + estimate > args.compile_budget_s or estimate + RESERVE_S > left:
            why = (f"the compile budget ({args.compile_budget_s:.0f} s, --compile-budget-s)"
                   if left > estimate + RESERVE_S else
                   f"the run's deadline ({args.deadline_s:.0f} s, --deadline-s; {left:.0f} s left)")
            runs.append(Run("hf-static", bs, error=f"skipped: a compile (~{estimate:.0f} s) would exceed {why}"))
            continue
        run = hf_runs(model, {bs: batches[bs]}, args, "hf-static", cache_implementation="static")[0]
        if run.error is None:
            run.compile_s = max(run.first_call_s - run.seconds, 0.0)
            spent += run.compile_s
            compiles += [run.compile_s] if run.compile_s > 5.0 else []
            estimate = DYNAMIC_COMPILE_S if len(compiles) >= 2 else max(compiles or [DYNAMIC_COMPILE_S])
        else:
            failed = bs
        runs.append(run)
    where = ("CUDA: torch.compile(mode='reduce-overhead')" if args.device.startswith("cuda") else
             "not compiled: transformers compiles its static-cache path only on accelerators")
    print(f"hf_decode: hf-static {where}; compile {spent:.1f} s in all", flush=True)
    return sorted(runs, key=lambda r: r.bs)


def lookup_runs(model: torch.nn.Module, batches: dict[int, Batch], args: argparse.Namespace) -> list[Run]:
    """(c) at batch 1; at batch 2 transformers refuses (recorded: that is where (e) runs and (c) cannot)."""
    # An EOS id no token can have: transformers' prompt lookup fails without one (torch.isin(drafts, None)).
    never = model.config.vocab_size
    runs = hf_runs(model, {1: batches[1]} if 1 in batches else {}, args, "hf-lookup",
                   prompt_lookup_num_tokens=args.draft_tokens, eos_token_id=never)
    bigger = [b for b in batches if b > 1]
    if bigger:
        batch = batches[bigger[0]]
        try:
            model.generate(input_ids=batch.ids, attention_mask=batch.mask, max_new_tokens=2, do_sample=False,
                           pad_token_id=0, prompt_lookup_num_tokens=args.draft_tokens, eos_token_id=never)
            refusal = None
        except ValueError as exc:
            refusal = f"refused by transformers: {exc}"
        runs += [Run("hf-lookup", b, error=refusal or "ran (not measured)") for b in bigger]
    return runs


def pool_runs(generator: Any, batches: dict[int, Batch], args: argparse.Namespace, speculate: bool) -> list[Run]:
    variant = "gp-lookup" if speculate else "gp-plain"
    top = max(batches)
    runs = []
    for bs, batch in batches.items():
        def call(batch=batch):
            policy = gp.SpeculationPolicy(off_above=top if speculate else 0)  # speculate at every size (or none)...
            gate = gp.AcceptanceGate(min_accept=1.3, window=8, pause_steps=32) if speculate else None  # ...that pays
            return generator.generate(batch.prompts, max_new_tokens=args.new_tokens, eos_token_id=[], seed=args.seed,
                                      policy=policy, gate=gate, **args.choice)

        def extra(result):
            return {"accept": result.accept_per_verify, "steps": len(result.steps), "misses": result.misses,
                    "verify_steps": len(result.steps_of("verify")),
                    "step_ms": 1e3 * result.decode_s / max(len(result.steps), 1)}
        runs.append(measure(variant, bs, call, args, lambda result: result.tokens, extra))
    return runs


def tier_runs(generator: Any, batches: dict[int, Batch], args: argparse.Namespace,
              tier_steps: dict[int, dict[str, int]]) -> list[Run]:
    """(f): each call with a fresh schedule from ``--tiers`` (its hysteresis state starts at the longest tier);
    fills ``tier_steps`` with each batch size's steps per mode (tier)."""
    runs = []
    for bs, batch in batches.items():
        def call(batch=batch):
            return generator.generate(batch.prompts, max_new_tokens=args.new_tokens, eos_token_id=[], seed=args.seed,
                                      policy=generator.tier_schedule(args.tiers), **args.choice)

        def extra(result, bs=bs):
            tier_steps[bs] = result.steps_by_mode
            return {"accept": result.accept_per_verify, "steps": len(result.steps), "misses": result.misses,
                    "verify_steps": sum(n for m, n in result.steps_by_mode.items() if m != "decode"),
                    "step_ms": 1e3 * result.decode_s / max(len(result.steps), 1)}
        runs.append(measure("gp-tiers", bs, call, args, lambda result: result.tokens, extra))
        print(f"hf_decode: gp-tiers   bs {bs:>3}: steps per tier " + ", ".join(
            f"{mode} {count}" for mode, count in tier_steps.get(bs, {}).items()), flush=True)
    return runs


def step_times(generator: Any, args: argparse.Namespace, iters: int = 200) -> dict[str, float]:
    """GPU milliseconds of one graphed step at batch 1, per mode (CUDA events around ``iters`` back-to-back
    replays on staged inputs; host clocks on the CPU twin). Median of 3."""
    out = {}
    cuda = args.device.startswith("cuda")
    iters = iters if cuda else 3
    for mode in generator.pool.modes:
        with torch.inference_mode():
            generator.pool.run(mode, **generator.sample_inputs(mode, 1))  # stages real inputs into the buffers
            graph = generator.pool.graph(mode, 1)
            for _ in range(10 if cuda else 1):
                graph.replay()
            samples = []
            for _ in range(3):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(iters):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / iters)
                else:
                    started = time.perf_counter()
                    for _ in range(iters):
                        graph.replay()
                    samples.append((time.perf_counter() - started) * 1e3 / iters)
        out[mode] = statistics.median(samples)
    return out


# ---------------------------------------------------------------------------------------------- main
def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    config = transformers.LlamaConfig(**(TINY if args.smoke else LLAMA_32_1B))
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialise on the device: 1.2 B random values are slow on the host
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=args.dtype)
    return model.to(args.device).eval()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started = time.perf_counter()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        outputs = OutputSet(*(Path(f"{args.out}{suffix}") for suffix in (".json", ".csv", ".png")))
    except OutputError as exc:
        raise SystemExit(f"hf_decode: {exc}") from None
    import transformers
    verbosity, threads = transformers.logging.get_verbosity(), torch.get_num_threads()
    transformers.logging.set_verbosity_error()  # generate()'s per-call notes would bury the progress lines
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)  # the smoke model's ops are too small to split across threads
    try:
        return run(args, outputs)
    finally:  # called in-process (the smoke test), the caller's settings come back
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)


def graphpool_runs(model: torch.nn.Module, batches: dict[int, Batch], args: argparse.Namespace,
                   max_len: int, tier_steps: dict) -> tuple[list[Run], dict[str, float], float | None]:
    """(d), (e) and with ``--tiers`` (f) from one PoolGenerator (captured once), and the graphed steps' GPU times;
    a failed capture is recorded on every one of their points."""
    from graphpool.integrations.transformers import PoolGenerator
    try:
        generator = PoolGenerator(model, max_len=max_len, batch_sizes=args.batch_sizes, progress=True,
                                  compile=args.compile,
                                  num_draft_tokens=tier_lengths(args.draft_tokens, args.tiers) if args.tiers
                                  else args.draft_tokens)
        if args.tiers:
            print(f"hf_decode: (f) tiers {generator.tier_schedule(args.tiers).describe()}", flush=True)
    except Exception as exc:
        log.exception("PoolGenerator failed")
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        variants = ("gp-plain", "gp-lookup") + (("gp-tiers",) if args.tiers else ())
        return [Run(v, bs, error=error) for v in variants for bs in batches], {}, None
    print(f"hf_decode: graphpool captured {len(generator.pool.graph_keys)} graphs in {generator.capture_s:.2f} s "
          f"({generator.cache!r})", flush=True)
    steps = step_times(generator, args)
    print("hf_decode: graphed step at bs 1: " + ", ".join(f"{m} {ms:.3f} ms" for m, ms in steps.items()), flush=True)
    runs = pool_runs(generator, batches, args, speculate=False) + pool_runs(generator, batches, args, speculate=True)
    if args.tiers:
        runs += tier_runs(generator, batches, args, tier_steps)
    generator.close()
    return runs, steps, generator.capture_s


def run(args: argparse.Namespace, outputs: OutputSet) -> int:
    """Every variant, then the files and the table."""
    import transformers
    started = args.started
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    smoke = args.smoke or not args.device.startswith("cuda")
    print(f"hf_decode: {'SMOKE RUN (CPU, eager twin: the code path, not a speed measurement); ' if smoke else ''}"
          f"Llama {'tiny' if args.smoke else '3.2-1B config'} ({params / 1e9:.3f} B parameters, random weights, "
          f"{args.dtype}) on {args.device}; transformers {transformers.__version__}, torch {torch.__version__}; "
          f"batch sizes {args.batch_sizes}, {args.new_tokens} new tokens per row, {args.draft_tokens} drafts; "
          f"{'sampled ' + str(args.choice) if args.sample else 'greedy'}; graphpool's step "
          f"{'compiled' if args.compile else 'eager modules'}; "
          f"model built in {time.perf_counter() - started:.1f} s", flush=True)
    prompts = make_prompts(max(args.batch_sizes), args.prompt_len, model.config.vocab_size, args.seed)
    batches = {bs: Batch.of(prompts[:bs], args.device) for bs in args.batch_sizes}
    max_len = max(map(len, prompts)) + args.new_tokens + args.draft_tokens

    tier_steps: dict[int, dict[str, int]] = {}
    runs, steps, capture_s = graphpool_runs(model, batches, args, max_len, tier_steps)
    runs += hf_runs(model, batches, args, "hf-eager")
    runs += lookup_runs(model, batches, args)
    runs += static_runs(model, batches, args)  # last: its compiled graphs and memory stay with the model
    meta = {"model": "tiny" if args.smoke else "Llama-3.2-1B config", "parameters": params,
            "dtype": str(args.dtype).replace("torch.", ""), "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "transformers": transformers.__version__, "torch": torch.__version__, "batch_sizes": args.batch_sizes,
            "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens,
            "prompt_lengths": [len(p) for p in prompts], "max_len": max_len, "capture_s": capture_s,
            "graphpool_step": ("the forward torch.compile'd (defaults, no CUDA graphs of its own), the sampler "
                               "eager, then captured in CUDA graphs" if args.compile
                               else "the model's eager modules captured in CUDA graphs (no torch.compile)"),
            "choice": args.choice, "sampled": args.sample, "compiled": args.compile,
            "hf_static": "generate(cache_implementation='static'): transformers' torch.compile(mode='reduce-overhead') "
                         "on CUDA, its default CompileConfig", "smoke": smoke,
            "tiers": [list(t) for t in args.tiers], "tier_steps": tier_steps,
            "seconds": time.perf_counter() - started}
    goals = check_goals(runs, steps, judged=not smoke, sampled=args.sample)
    try:
        with outputs:
            write_outputs(outputs, meta, runs, steps, goals)
    except OutputError as exc:
        raise SystemExit(f"hf_decode: {exc}") from None
    if args.tiers:  # (f) is outside the table's fixed columns: its line comes just before the table
        lookup = {r.bs: r.tokens_per_s for r in runs if r.variant == "gp-lookup"}
        print("hf_decode: (f) gp-tiers tokens/s (x (e)), match vs (a): " + "; ".join(
            f"bs {r.bs} {r.tokens_per_s:.0f} ({r.tokens_per_s / lookup[r.bs]:.2f}x), {r.match_vs_eager:.2f}"
            if r.tokens_per_s and lookup.get(r.bs) and r.match_vs_eager is not None else f"bs {r.bs} {r.error or '-'}"
            for r in runs if r.variant == "gp-tiers"), flush=True)
    print(table(runs, steps, goals, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
