"""The decode loop, end to end, against an independent greedy oracle (issue 5, acceptance 1).

CPU runs use the pool's eager twin at the tiny size in float32; the same tests run on the GPU with
CUDA graphs (``-m gpu``). The oracle recomputes every token from scratch (no KV cache, no paging, no
batching), so plain decode is checked against it and the speculative variants against plain decode.
"""
from __future__ import annotations

import pytest
import torch

from bench.engine.attention import reference_attention
from bench.engine.config import ModelConfig, SpecConfig
from bench.engine.harness import build
from bench.engine.loop import DecodeLoop, make_requests
from graphpool import SpeculationPolicy

CFG, PROMPT = ModelConfig.tiny(), 12


class DenseCausal:
    """No-cache attention for one sequence; records each layer's K (for the draft-KV check)."""

    def __init__(self):
        self.keys = {}

    def __call__(self, layer_id, q, k, v):
        self.keys[layer_id] = k
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool, device=q.device).tril())


def oracle_greedy(model, prompt, n):
    seq = torch.tensor(prompt, device=model.embed.weight.device)
    for _ in range(n):
        logits = model.logits(model(seq, torch.arange(len(seq), device=seq.device), DenseCausal()))
        seq = torch.cat([seq, logits[-1].argmax().view(1)])
    return seq[len(prompt):].tolist()


class Alternate:
    """A stand-in policy that flips modes every few steps, so both switch directions are exercised."""

    def __init__(self, every=3):
        self.every, self.calls = every, 0

    def choose(self, bs):
        self.calls += 1
        return "verify" if (self.calls // self.every) % 2 else "decode"


def _engine(device, cfg=CFG, spec=None, tp=None, attention="torch"):
    spec = spec or SpecConfig(topk=2, steps=3, num_draft_tokens=6, draft_noise=0.1)
    return build(cfg, spec, [1, 2, 4], PROMPT, 24, device=device, dtype=torch.float32, tp=tp, attention=attention)


def _check_variants(device, cfg=CFG, spec=None, tp=None, attention="torch"):
    """Also runs on every rank of a tensor-parallel engine (tests/test_engine_tp.py): the oracle then runs
    the rank's sharded model, whose collectives every rank joins in the same order."""
    engine, pool = _engine(device, cfg, spec, tp, attention)
    reqs = make_requests(7, PROMPT, cfg.vocab_size, 8, 24, seed=3)
    plain = DecodeLoop(engine, pool, "plain").run(reqs, 3)  # 3 pads to the bs-4 graphs
    for r in reqs[:3]:
        assert plain.outputs[r.rid] == oracle_greedy(engine.target, r.prompt.tolist(), r.max_new)
    runs = {"spec": DecodeLoop(engine, pool, "spec").run(reqs, 4),
            "dynamic": DecodeLoop(engine, pool, "dynamic", SpeculationPolicy(2, 1)).run(reqs, 4),
            "dynamic_eager_plain": DecodeLoop(engine, pool, "dynamic_eager_plain", SpeculationPolicy(2, 1)).run(reqs, 4),
            "alternate": DecodeLoop(engine, pool, "dynamic", Alternate()).run(reqs, 2)}
    for name, st in runs.items():
        assert st.outputs == plain.outputs, name
        assert st.tokens == plain.tokens == sum(r.max_new for r in reqs)
        assert st.graph_misses == 0
    assert runs["spec"].mean_accept > 1.5  # the draft is useful
    assert runs["dynamic"].steps["decode"] and runs["dynamic"].steps["verify"]  # it switched
    assert runs["dynamic_eager_plain"].steps["eager_decode"] and not runs["dynamic_eager_plain"].steps["decode"]
    assert runs["alternate"].catch_ups > 0
    return engine, pool


@pytest.mark.parametrize("attention", ["torch", "flashinfer-reference"])
def test_variants_match_plain_decode_and_oracle_cpu(attention):
    """Both attention backends' metadata paths (FlashInfer's in-graph metadata with the torch reference
    kernel) give the oracle's greedy output, with and without speculation."""
    _check_variants("cpu", attention=attention)


@pytest.mark.gpu
def test_variants_match_plain_decode_and_oracle_gpu():
    engine, pool = _check_variants("cuda")
    assert pool.stats.backend.startswith("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["torch", "flashinfer-reference"])
def test_variants_match_plain_decode_benchmark_model_fp32_gpu(attention):
    """The benchmark's model (medium, 1.75 B), draft noise and tree (topk 4 x steps 4, 16 verified tokens),
    in float32 with CUDA graphs (fused kernels; FlashInfer's in-graph metadata with the reference kernel)."""
    from bench.decode_loop import PRESETS
    _check_variants("cuda", ModelConfig.medium(), SpecConfig(draft_noise=PRESETS["medium"].draft_noise),
                    attention=attention)


@pytest.mark.gpu
def test_flashinfer_decode_loop_runs_on_graphs_bf16_gpu():
    """FlashInfer's kernels in bf16 through the whole loop: every step a graph hit, the draft useful, and
    plain decoding close to the torch attention's (bf16 near-ties may break differently)."""
    from bench.engine.fi_attention import flashinfer_available
    if not flashinfer_available():
        pytest.skip("needs flashinfer")
    from dataclasses import replace
    cfg = replace(CFG, num_heads=32, num_kv_heads=4, head_dim=128)  # the benchmark's attention shape
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6, draft_noise=0.1)
    reqs = make_requests(7, PROMPT, cfg.vocab_size, 8, 24, seed=3)
    outs = {}
    for attention in ("flashinfer", "torch"):
        engine, pool = build(cfg, spec, [1, 2, 4], PROMPT, 24, device="cuda", dtype=torch.bfloat16,
                             attention=attention)
        assert engine.attention == attention
        plain = DecodeLoop(engine, pool, "plain").run(reqs, 3)
        dyn = DecodeLoop(engine, pool, "dynamic", Alternate()).run(reqs, 2)
        assert plain.graph_misses == dyn.graph_misses == 0
        assert plain.tokens == dyn.tokens == sum(r.max_new for r in reqs)
        assert dyn.mean_accept > 1.5 and dyn.steps["decode"] and dyn.steps["verify"]
        outs[attention] = plain.outputs
    same = sum(a == b for a, b in zip(outs["flashinfer"].values(), outs["torch"].values()))
    assert same >= len(reqs) // 2, f"only {same} of {len(reqs)} outputs agree between FlashInfer and torch"


@pytest.mark.parametrize("ahead", [1, 3])
def test_run_ahead_reads_accept_lengths_late_and_changes_nothing(ahead):
    """With run-ahead the host queues verify steps before reading earlier ones' accept lengths (up to
    ``ahead`` unread), yet serves the same steps, outputs and counted tokens as a sync per step (waiting
    at request ends, so that both serve the same batches step by step)."""
    engine, pool = _engine("cpu")
    reqs = make_requests(6, PROMPT, CFG.vocab_size, 20, 24, seed=7)
    base = DecodeLoop(engine, pool, "spec", run_ahead=0).run(reqs, 3, warmup_steps=2, max_steps=6)
    full = DecodeLoop(engine, pool, "spec", run_ahead=0).run(reqs, 3)
    unread_at_push = []
    loop = DecodeLoop(engine, pool, "spec", run_ahead=ahead, wait_at_request_end=True)
    push, resolve = loop.accept_ring.push, loop._resolve
    counts = {"push": 0, "resolve": 0}

    def counting_push(*args):
        unread_at_push.append(counts["push"] - counts["resolve"])
        counts["push"] += 1
        return push(*args)

    def counting_resolve(*args):
        counts["resolve"] += 1
        return resolve(*args)

    loop.accept_ring.push, loop._resolve = counting_push, counting_resolve
    late_full = loop.run(reqs, 3)
    assert late_full.outputs == full.outputs and late_full.tokens == full.tokens
    assert late_full.mean_accept == full.mean_accept
    assert max(unread_at_push) == ahead and min(unread_at_push) == 0 and counts["push"] == counts["resolve"]
    late = DecodeLoop(engine, pool, "spec", run_ahead=ahead, wait_at_request_end=True).run(
        reqs, 3, warmup_steps=2, max_steps=6)
    assert (late.tokens, late.steps, late.accept_rows) == (base.tokens, base.steps, base.accept_rows)
    assert late.partial == base.partial and late.outputs == base.outputs


@pytest.mark.parametrize("ahead", [1, 2])
def test_requests_end_and_start_while_a_step_is_in_flight(ahead):
    """By default the loop does not wait when some requests of a batch may have finished: a finished one
    is retired, and a new one admitted, while a verify step is still in flight (the next step's lengths
    then come from the device for the requests that stay). Every request still gets exactly plain
    decoding's tokens, and dynamic speculation too; with ``wait_at_request_end`` no batch changes in flight."""
    engine, pool = _engine("cpu")
    reqs = make_requests(9, PROMPT, CFG.vocab_size, 6, 24, seed=11)  # uneven lengths: ends at many steps
    plain = DecodeLoop(engine, pool, "plain").run(reqs, 3)
    for variant, policy in (("spec", None), ("dynamic", SpeculationPolicy(2, 1))):
        for wait in (False, True):
            loop = DecodeLoop(engine, pool, variant, policy, run_ahead=ahead, wait_at_request_end=wait)
            changed, next_inputs = [], loop._next_inputs

            def spy(lens_dev, rows_dev, kept, act, n_kept, _next=next_inputs, _changed=changed):
                _changed.append(kept is not None or n_kept != len(act.reqs))
                return _next(lens_dev, rows_dev, kept, act, n_kept)
            loop._next_inputs = spy
            st = loop.run(reqs, 3 if variant == "spec" else 4)
            assert st.outputs == plain.outputs, (variant, wait)
            assert st.tokens == plain.tokens == sum(r.max_new for r in reqs)
            assert st.graph_misses == 0
            if variant == "spec":  # dynamic at C = 3-4 > threshold 2 decodes until the batch thins out
                assert any(changed) != wait, (variant, wait, sum(changed))
            else:
                assert not wait or not any(changed)


def test_draft_kv_after_catch_up_equals_fresh_draft_prefill():
    _check_catch_up("cpu")


def _check_catch_up(device, tp=None):
    engine, pool = _engine(device, tp=tp)
    (req,) = make_requests(1, PROMPT, CFG.vocab_size, 20, 20, seed=5)
    loop = DecodeLoop(engine, pool, "plain")
    row = int(loop._admit([req])[0])
    lens, rows = torch.tensor([PROMPT], device=engine.device), torch.tensor([row], device=engine.device)
    for _ in range(10):  # plain steps leave the draft KV behind
        pool.run("decode", seq_lens=lens, req_pool_indices=rows)
        lens += 1
    upto = int(lens) - 1
    engine.draft_catch_up(row, PROMPT - 1, upto)
    dense = DenseCausal()
    engine.draft(engine.token_table[row, :upto], torch.arange(upto, device=engine.device), dense)
    slots = engine.req_to_token[row, :upto]
    torch.testing.assert_close(engine.draft_attn.cache.k[0][slots], dense.keys[0], rtol=1e-4, atol=1e-4)
    engine.rows.free(row)


def test_every_step_replays_a_graph():
    _check_every_step_replays("cpu")


def _check_every_step_replays(device, tp=None):
    engine, pool = _engine(device, tp=tp)
    before = pool.stats.replays
    st = DecodeLoop(engine, pool, "dynamic", SpeculationPolicy(2, 1)).run(
        make_requests(5, PROMPT, CFG.vocab_size, 6, 12), 4)
    steps = st.steps["decode"] + st.steps["verify"]
    assert pool.stats.replays - before >= steps and not pool.stats.misses


@pytest.mark.parametrize("n", [1, 5, 64, 1500])
def test_advance_lengths_kernel_matches_torch(n):
    """The run-ahead loop's one launch after a verify step (next seq_lens on the device, the accept lengths
    into the host buffer) against the torch ops it replaces; on CPU in Triton's interpreter, on the GPU
    into pinned memory read after an event, as the loop reads it."""
    from bench.engine.transfer import advance_lengths, triton
    if triton is None:
        pytest.skip("needs Triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(1, 4000, (n,), generator=g).to(device)
    accepted = torch.randint(1, 6, (n,), generator=g).to(device)
    nxt = torch.full((n,), -1, dtype=torch.int64, device=device)
    host = torch.full((n,), -1, dtype=torch.int64, pin_memory=device == "cuda")
    advance_lengths(lens, accepted, nxt, host, kernel=True)
    if device == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    assert torch.equal(nxt, lens + accepted)
    assert torch.equal(host, accepted.cpu())
