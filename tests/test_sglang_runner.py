"""MultiModeCudaGraphRunner against eager execution and against SGLang's single-mode routing.

A random sequence of DECODE and TARGET_VERIFY steps at random batch sizes is routed by SGLang's own
``ModelRunner._forward_raw`` twice: once into the multi-mode runner, once eagerly (no graph runner).
Every output and the final KV caches must agree. The same sequence through a verify-only runner with
SGLang's routing (the real ``CudaGraphRunner.can_run`` / ``replay_prepare`` / input buffers) reproduces
the "160 vs 2" shape error.
"""
from __future__ import annotations

import inspect
import random

import pytest
import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

H.require_api("classic")  # the runner API (SGLang 0.5.14+) has its own tests

from sglang.srt.model_executor import cuda_graph_runner as sglang_runner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from graphpool.integrations.sglang import MultiModeCudaGraphRunner


def _runner_world(cfg: H.HarnessConfig, device: torch.device):
    mr = H.HarnessModelRunner(cfg, device, speculative=True)
    mr.graph_runner = MultiModeCudaGraphRunner(mr)
    return mr


def _random_steps(cfg: H.HarnessConfig, n_steps: int, seed: int):
    rng = random.Random(seed)
    steps = []
    for _ in range(n_steps):
        mode = rng.choice([ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
        bs = rng.randint(1, max(cfg.batch_sizes))
        steps.append((mode, sorted(rng.sample(range(cfg.max_reqs), bs))))
    return steps


def _run_step(mr, reqs, alloc, mode, rows, gen):
    """Build the step (same tokens for every world via ``gen``), run it, commit one token per row."""
    if mode == ForwardMode.DECODE:
        fb = H.decode_batch(mr, reqs, rows, alloc)
    else:
        drafts = torch.randint(0, mr.cfg.vocab, (len(rows), mr.cfg.draft_tokens - 1), generator=gen)
        fb = H.verify_batch(mr, reqs, rows, drafts, alloc)
    out = mr.forward(fb)
    for r in rows:  # advance by one token; its KV was written by this step at the first token's slot
        reqs.tokens[r].append(int(torch.randint(0, mr.cfg.vocab, (1,), generator=gen)))
    return out


def _drive(mr, steps, seed):
    cfg = mr.cfg
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=seed)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for mode, rows in steps:
        out = _run_step(mr, reqs, alloc, mode, rows, gen)
        outs.append((out.can_run_graph, out.logits_output.next_token_logits.clone(),
                     out.logits_output.hidden_states.clone()))
    return outs


def _check_against_eager(device: torch.device, atol: float, n_steps: int = 40):
    cfg = H.HarnessConfig(dtype=torch.float64 if device.type == "cpu" else torch.float32)
    steps = _random_steps(cfg, n_steps, seed=1)
    graph = _runner_world(cfg, device)
    eager = H.HarnessModelRunner(cfg, device, speculative=True)
    got, want = _drive(graph, steps, seed=2), _drive(eager, steps, seed=2)
    for i, ((ran_graph, logits, hidden), (_, e_logits, e_hidden)) in enumerate(zip(got, want)):
        mode, rows = steps[i]
        assert ran_graph, f"step {i} ({mode.name}, bs={len(rows)}) did not replay a graph"
        assert logits.shape == e_logits.shape == (len(rows) * graph.graph_runner.tokens_per_mode[mode], cfg.vocab)
        torch.testing.assert_close(logits, e_logits, atol=atol, rtol=0, msg=f"step {i} {mode.name} logits")
        torch.testing.assert_close(hidden, e_hidden, atol=atol, rtol=0, msg=f"step {i} {mode.name} hidden")
    # The KV each step wrote: every slot but the dummy slot 0, which padded rows scribble on.
    torch.testing.assert_close(graph.token_to_kv_pool.k_buffer[:, 1:], eager.token_to_kv_pool.k_buffer[:, 1:],
                               atol=atol, rtol=0)
    # Every step reached the attention backend with its own forward mode and its padded batch size.
    runner = graph.graph_runner
    assert [m for m, _ in graph.attn_backend.replay_log] == [m for m, _ in steps]
    assert [bs for _, bs in graph.attn_backend.replay_log] == [runner.pool.route(
        "decode" if m == ForwardMode.DECODE else "target_verify", len(r)) for m, r in steps]
    return graph


def test_random_decode_and_verify_steps_equal_eager_cpu():
    graph = _check_against_eager(torch.device("cpu"), atol=1e-10)
    runner = graph.graph_runner
    assert runner.pool.backend.name == "eager"
    assert graph.attn_backend.graph_state_inits == [(64, 64 * 4)], "graph state: once, sized for the largest mode"


@pytest.mark.gpu
def test_random_decode_and_verify_steps_equal_eager_cuda():
    graph = _check_against_eager(torch.device("cuda"), atol=2e-4, n_steps=60)
    runner = graph.graph_runner
    assert runner.pool.backend.name == "cuda"
    assert sglang_runner.get_global_graph_memory_pool() is runner.pool.memory_pool
    assert len(runner.graphs) == 2 * len(runner.capture_bs)
    print(runner.pool.stats.table())


def test_sglang_single_mode_routing_reproduces_160_vs_2():
    """The same kind of step sequence through a verify-only runner with SGLang's own routing code fails
    on the first plain DECODE step with the shape error; the multi-mode runner never raises."""
    cfg = H.HarnessConfig()
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    mr.graph_runner = _sglang_verify_only_runner(mr)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=3)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    fb = H.decode_batch(mr, reqs, list(range(10)), alloc)
    assert mr.graph_runner.can_run(fb), "SGLang's can_run checks the batch size only, never the mode"
    with pytest.raises(RuntimeError, match=r"size of tensor a \(40\) must match the size of tensor b \(10\)"):
        mr.forward(fb)
    # The multi-mode runner routes the same step to its DECODE graph.
    ours = _runner_world(cfg, torch.device("cpu"))
    H.prefill(ours, reqs, H.SlotAllocator(cfg.kv_slots))
    out = ours.forward(H.decode_batch(ours, reqs, list(range(10)), H.SlotAllocator(cfg.kv_slots)))
    assert out.can_run_graph and out.logits_output.next_token_logits.shape == (10, cfg.vocab)
    assert ours.attn_backend.replay_log[-1] == (ForwardMode.DECODE, 16)


def _sglang_verify_only_runner(mr):
    """SGLang's ``CudaGraphRunner`` routing on a verify-only runner, without its GPU capture: the real
    ``can_run``, ``replay_prepare`` and ``DecodeInputBuffers``; capture is skipped (the error happens
    while staging, before any replay)."""
    # SGLang 0.5.9 keeps its buffers on the runner itself; 0.5.10 to 0.5.12 use DecodeInputBuffers; 0.5.13
    # allocates a namespace of buffers and stages through a buffer registry.
    registry = hasattr(sglang_runner, "build_decode_registry")
    if not hasattr(sglang_runner, "DecodeInputBuffers") and not registry:
        pytest.skip("this SGLang (0.5.9) has no DecodeInputBuffers to stage its own routing with")
    runner = object.__new__(sglang_runner.CudaGraphRunner)
    tokens = mr.cfg.draft_tokens
    fields = dict(
        model_runner=mr, graphs={}, output_buffers={}, disable_padding=False, is_encoder_decoder=False,
        require_gathered_buffer=False, require_mlp_tp_gather=False, require_mlp_sync=False,
        enable_two_batch_overlap=False, enable_pdmux=False, record_nolora_graph=False, nsa_enable_prefill_cp=False,
        capture_forward_mode=ForwardMode.TARGET_VERIFY, capture_hidden_mode=CaptureHiddenMode.FULL,
        num_tokens_per_bs=tokens, capture_bs=list(mr.cfg.batch_sizes), max_bs=max(mr.cfg.batch_sizes),
        seq_len_fill_value=1, attn_backend=mr.attn_backend, is_dllm=False,
        deepep_adapter=sglang_runner.DeepEPCudaGraphRunnerAdapter())
    runner.__dict__.update(fields)
    sizes = dict(device="cpu", max_bs=runner.max_bs, max_num_token=runner.max_bs * tokens, seq_len_fill_value=1,
                 cache_loc_dtype=torch.int64, enable_mamba_track=False, is_encoder_decoder=False,
                 encoder_len_fill_value=0, require_mlp_tp_gather=False, dp_size=1)
    make = sglang_runner._allocate_decode_buffers if registry else sglang_runner.DecodeInputBuffers.create
    runner.buffers = make(hidden_size=mr.cfg.hidden, vocab_size=mr.cfg.vocab, dtype=mr.cfg.dtype, pp_size=1,
                          num_tokens_per_bs=tokens, **sizes)
    if registry:  # SGLang 0.5.13
        runner.buffer_registry = sglang_runner.build_decode_registry(source=runner.buffers, **sizes)
    return runner


@pytest.fixture(autouse=True)
def _no_expert_parallel(monkeypatch):
    # SGLang asks its (uninitialised, single-process) expert-parallel group whether MoE padding applies.
    monkeypatch.setattr(sglang_runner, "enable_num_token_non_padded", lambda *args: False)  # 0.5.11 takes server_args


def test_signatures_match_sglang_cuda_graph_runner():
    """Every call SGLang makes fits: SGLang's parameters, in order, with its kinds and defaults; ours may add
    keyword-only parameters with defaults (a later SGLang's, e.g. adaptive speculation's from 0.5.12)."""
    ours, theirs = MultiModeCudaGraphRunner, sglang_runner.CudaGraphRunner
    for name in ("__init__", "can_run", "capture", "replay_prepare", "replay", "get_spec_info"):
        got, want = inspect.signature(getattr(ours, name)), inspect.signature(getattr(theirs, name))
        want_params = [(p.name, p.kind, p.default) for p in want.parameters.values()]
        got_params = {p.name: p for p in got.parameters.values()}
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()][:len(want_params)] == want_params or \
            [(n, got_params[n].kind, got_params[n].default) for n, _, _ in want_params if n in got_params] == \
            want_params, f"{name}: {got} != {want}"
        extra = [p for n, p in got_params.items() if n not in {w[0] for w in want_params}]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), f"{name}: {got} vs {want}"


def test_attributes_of_sglang_runner_exist_and_hidden_mode_is_per_mode():
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    runner = MultiModeCudaGraphRunner(mr)
    for attr in ("graphs", "output_buffers", "capture_bs", "max_bs", "num_tokens_per_bs", "capture_hidden_mode",
                 "bs", "raw_bs", "raw_num_token", "capture_forward_mode", "attn_backend", "model_runner", "device",
                 "seq_len_fill_value", "max_num_token", "compile_bs", "speculative_num_steps",
                 "speculative_num_draft_tokens"):
        assert hasattr(runner, attr), attr
    assert runner.capture_forward_mode == ForwardMode.TARGET_VERIFY and runner.num_tokens_per_bs == 4
    assert set(runner.graphs) == {(m, bs) for m in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) for bs in (1, 2, 4)}
    assert runner.capture_hidden_modes == {ForwardMode.DECODE: CaptureHiddenMode.FULL,
                                           ForwardMode.TARGET_VERIFY: CaptureHiddenMode.FULL}
    plain = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=False)
    runner = MultiModeCudaGraphRunner(plain)
    assert set(runner.graphs) == {(ForwardMode.DECODE, bs) for bs in (1, 2, 4)}
    assert runner.capture_hidden_mode == CaptureHiddenMode.NULL and runner.num_tokens_per_bs == 1


def test_every_graph_copies_its_logits_into_one_shared_buffer():
    """As SGLang's runner does (``next_token_logits_buffer``): without it every graph kept its own float32
    logits in the graph pool, and live the DECODE + TARGET_VERIFY graphs took 3.8x SGLang's graph memory."""
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    runner = MultiModeCudaGraphRunner(H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True))
    shared = runner.logits_buffer
    assert shared is not None and shared.dtype == torch.float32
    assert tuple(shared.shape) == (runner.max_num_token, cfg.vocab)
    for (mode, bs), fb in runner._capture_batches.items():
        tokens = bs * runner.tokens_per_mode[mode]
        buf = fb.next_token_logits_buffer
        assert buf.data_ptr() == shared.data_ptr() and tuple(buf.shape) == (tokens, cfg.vocab), (mode, bs)


def test_eagle_v2_split_replay_prepare_then_replay():
    """EAGLE v2 calls can_run, replay_prepare, reads .bs, then replay(skip_attn_backend_init=True); from
    SGLang 0.5.13 it marks the batch (``mark_forward_metadata_ready``) and ``_forward_raw`` calls
    ``replay(fb, pp_proxy_tensors=...)``. Either way attention is planned once, by replay_prepare."""
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4, 8))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    runner = mr.graph_runner = MultiModeCudaGraphRunner(mr)
    eager = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=5)
    for world in (mr, eager):
        H.prefill(world, reqs, H.SlotAllocator(cfg.kv_slots))
    drafts = torch.randint(0, cfg.vocab, (3, cfg.draft_tokens - 1), generator=torch.Generator().manual_seed(0))
    fb = H.verify_batch(mr, reqs, [0, 1, 2], drafts, H.SlotAllocator(cfg.kv_slots))
    assert runner.can_run(fb)
    runner.replay_prepare(fb)
    assert (runner.bs, runner.raw_bs, runner.raw_num_token) == (4, 3, 12)
    planned = len(mr.attn_backend.replay_log)
    if hasattr(fb, "mark_forward_metadata_ready"):  # SGLang 0.5.13: the marker, through SGLang's _forward_raw
        fb.mark_forward_metadata_ready()
        out = mr.forward(fb).logits_output
    else:
        out = runner.replay(fb, skip_attn_backend_init=True)
    assert len(mr.attn_backend.replay_log) == planned, "replay re-planned a batch replay_prepare planned"
    want = eager.forward(H.verify_batch(eager, reqs, [0, 1, 2], drafts, H.SlotAllocator(cfg.kv_slots)))
    torch.testing.assert_close(out.next_token_logits, want.logits_output.next_token_logits, atol=1e-10, rtol=0)


def test_can_run_rejects_what_no_graph_serves():
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    runner = MultiModeCudaGraphRunner(mr)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=6)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    assert runner.can_run(H.decode_batch(mr, reqs, [0, 1, 2], alloc))
    assert not runner.can_run(H.decode_batch(mr, reqs, list(range(5)), alloc)), "bs above the largest graph"
    fb = H.decode_batch(mr, reqs, [0, 1], alloc)
    fb.forward_mode = ForwardMode.EXTEND
    assert not runner.can_run(fb), "no EXTEND graphs"
    fb = H.decode_batch(mr, reqs, [0, 1], alloc, input_ids=torch.zeros(8, dtype=torch.int64))
    assert not runner.can_run(fb), "a DECODE step must carry one token per sequence"
    fb = H.decode_batch(mr, reqs, [0, 1], alloc)
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    assert not runner.can_run(fb), "hidden states the DECODE graphs were not captured with"
    assert runner.refusals == {"decode bs 5 > 4": 1, "decode with 8 tokens for bs 2": 1,
                               "decode asks hidden states LAST, captured FULL": 1}
    assert "eager fallbacks: decode asks hidden states LAST, captured FULL: 1" in runner.replay_log.line()


def test_hidden_modes_fixed_at_construction_and_seq_lens_staged_without_allocating():
    """No recapture on the step path: a batch that needs no hidden states replays the FULL graphs; one
    that needs hidden states no graph returns runs eagerly through SGLang's routing. int64 seq_lens are
    staged through the runner's int32 buffer, allocated once."""
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    runner = mr.graph_runner = MultiModeCudaGraphRunner(mr)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=7)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    captures, staged = [], []
    capture, stage = runner.capture, runner.pool.stage
    runner.capture = lambda: captures.append(1) or capture()
    runner.pool.stage = lambda mode, **kw: staged.append(kw["seq_lens"]) or stage(mode, **kw)
    fb = H.decode_batch(mr, reqs, [0, 1, 2], alloc)
    fb.capture_hidden_mode = CaptureHiddenMode.NULL
    assert fb.seq_lens.dtype == torch.int64
    out = mr.forward(fb)
    assert out.can_run_graph and not captures
    assert staged[-1].dtype == torch.int32 and staged[-1].tolist() == fb.seq_lens.tolist()
    assert staged[-1].untyped_storage().data_ptr() == runner._seq_lens_int32.untyped_storage().data_ptr()
    fb = H.decode_batch(mr, reqs, [3, 4], alloc)
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    out = mr.forward(fb)
    assert not out.can_run_graph and not captures, "eager, as SGLang's runner does for an uncaptured hidden mode"
    assert runner.replay_log.counts == {ForwardMode.DECODE: 1}


def test_unsupported_server_is_refused_with_the_reasons():
    cfg = H.HarnessConfig(batch_sizes=(1, 2))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=False)
    mr.server_args.enable_two_batch_overlap = True
    mr.server_args.pp_size = 2
    with pytest.raises(ValueError, match=r"two-batch overlap \(--enable-two-batch-overlap\), pipeline parallelism "
                                         r"\(--pp-size 2\)"):
        MultiModeCudaGraphRunner(mr)


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()


# Found by an independent review of the runner against SGLang's callers ---------------------------------------
def _prefilled(speculative: bool, batch_sizes=(1, 2, 4)):
    cfg = H.HarnessConfig(batch_sizes=batch_sizes)
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=speculative)
    mr.graph_runner = MultiModeCudaGraphRunner(mr)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=11)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    return mr, reqs, alloc


def test_can_run_is_false_for_a_mode_the_runner_holds_no_graphs_of(monkeypatch):
    """A non-speculative runner holds DECODE graphs only: a TARGET_VERIFY batch gets False (SGLang then runs
    it eagerly), not an exception from the pool."""
    monkeypatch.setattr(sglang_runner, "enable_num_token_non_padded", lambda *args: False)  # 0.5.11 takes server_args
    mr, reqs, alloc = _prefilled(speculative=False)
    drafts = torch.zeros((2, mr.cfg.draft_tokens - 1), dtype=torch.int64)
    assert mr.graph_runner.can_run(H.verify_batch(mr, reqs, [0, 1], drafts, alloc)) is False
    decode = H.decode_batch(mr, reqs, [0, 1], alloc)
    decode.capture_hidden_mode = CaptureHiddenMode.NULL  # no speculation: no hidden states asked
    assert mr.graph_runner.can_run(decode) is True


def test_replay_of_a_mode_without_graphs_or_past_the_largest_graph_says_so(monkeypatch):
    """replay() of an IDLE/EXTEND batch names the modes it holds (no bare KeyError); a DECODE batch larger than
    every graph gets the pool's BatchTooLargeError naming the size, not a shape error from staging seq_lens."""
    from graphpool import BatchTooLargeError, UnknownModeError

    monkeypatch.setattr(sglang_runner, "enable_num_token_non_padded", lambda *args: False)  # 0.5.11 takes server_args
    mr, reqs, alloc = _prefilled(speculative=True)
    for mode in (ForwardMode.IDLE, ForwardMode.EXTEND):
        fb = H.decode_batch(mr, reqs, [0, 1], alloc)
        fb.forward_mode = mode
        with pytest.raises(UnknownModeError, match=rf"graphs for \['DECODE', 'TARGET_VERIFY'\], none for {mode.name}"):
            mr.graph_runner.replay(fb)
    fb = H.decode_batch(mr, reqs, [0, 1, 2, 3, 4], alloc)  # int64 seq_lens, bs 5 > 4
    assert fb.seq_lens.dtype == torch.int64 and not mr.graph_runner.can_run(fb)
    with pytest.raises(BatchTooLargeError, match="batch size 5 is larger than the largest captured size 4"):
        mr.graph_runner.replay(fb)
