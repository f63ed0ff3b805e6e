"""The runner-API adapter and the spec-v2 switch on SGLang's defaults (issue 26, SGLang 0.5.14 to 0.5.23).

Each test comes from a finding of a review of SGLang's sources against the integration and fails without its
fix. Oracles: SGLang's real ``FutureMap`` (the overlap scheduler's length relay), ``ScheduleBatch``,
``SamplingBatchInfo`` and ``Sampler``, ``ForwardBatch.init_new`` and the draft worker's own draft prefill
(``_draft_extend_for_prefill``), the scheduler's ``_apply_war_barrier``, ``build_replay_fb_view``,
``GraphSharedOutput``, ``ServerArgs`` with its CLI parser and resolution; eager execution; a fresh draft prefill.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)
from tests import sglang_harness as H

from sglang.srt import runtime_context
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from graphpool.integrations.sglang import spec_switch_v2 as v2
from graphpool.integrations.sglang import support
from graphpool.integrations.sglang.draft_lag import DraftLag
from graphpool.integrations.sglang.launch import GraphpoolOptions, check_server_args
from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()
    yield
    v2.uninstall_speculation_switch()


def _triton_like(mr):
    """The harness backend as SGLang's Triton backend declares itself (no host lengths needed), recording what
    each replay plans from."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    backend, planned = mr.attn_backend, []
    backend.needs_cpu_seq_lens = TritonAttnBackend.needs_cpu_seq_lens
    plan = backend.init_forward_metadata_out_graph

    def recording(fb, in_capture=False):
        if not in_capture:
            planned.append(fb.seq_lens_cpu)
        return plan(fb, in_capture)
    backend.init_forward_metadata_out_graph = recording
    return planned


def _future_map(mr, needs_cpu_seq_lens):
    from sglang.srt.managers.overlap_utils import FutureMap

    return FutureMap(mr.device, mr.spec_algorithm, mr.req_to_token_pool, needs_cpu_seq_lens=needs_cpu_seq_lens)


def _overlap_step(fm, batch, lens):
    """What the overlap scheduler does before a spec-v2 step: the previous step published the lengths, this
    one resolves them (SGLang's real FutureMap), dropping the host copy where no backend needs one."""
    batch.spec_info.future_indices = batch.req_pool_indices
    fm.publish(batch.req_pool_indices, lens)
    fm.resolve_seq_lens_cpu(batch)


# ----------------------------------------------------------------------------------------- finding 1
def test_plain_step_and_catch_up_under_overlap_without_host_lengths():
    """SGLang's default (overlap on) with FA3, Triton or trtllm_mha: ``resolve_seq_lens_cpu`` leaves
    ``batch.seq_lens_cpu`` and ``seq_lens_sum`` None. The plain step and the catch-up must work from the device
    lengths and give what they give with host lengths; the replay plans with no stale host copy."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert TritonAttnBackend.needs_cpu_seq_lens is False, "SGLang's Triton backend needs no host lengths"
    results = {}
    for host in (True, False):
        mr, reqs, alloc = R.world()
        planned = _triton_like(mr)
        rows = [0, 1, 2]
        idx, lens, bonus = R.plain_step_inputs(mr, reqs, alloc, rows)
        batch = R.spec_v2_batch(mr, idx, lens, bonus, reqs=reqs)
        fm = _future_map(mr, needs_cpu_seq_lens=host)
        _overlap_step(fm, batch, lens)
        assert (batch.seq_lens_cpu is None) == (not host) and batch.seq_lens.tolist() == lens.tolist()
        lag, seen = DraftLag(keep_hidden=False), []
        worker = R.spec_v2_worker(mr, draft_worker=SimpleNamespace(
            _draft_extend_for_prefill=lambda view, hidden, tokens: seen.append(view) or SimpleNamespace()))
        res = v2.eagle_v2_plain_decode(worker, batch, lag, functools.partial(fm.publish, batch.req_pool_indices))
        assert res.can_run_cuda_graph and (planned[-1] is None) == (not host)
        new = res.next_token_ids.tolist()
        # The next (speculative) step: the lengths the plain step published, then the catch-up.
        for r, t in zip(rows, new):
            reqs.tokens[r].append(t)
        nxt = R.spec_v2_batch(mr, idx, lens + 1, res.next_draft_input.bonus_tokens, reqs=reqs)
        _overlap_step(fm, nxt, res.new_seq_lens)
        assert (nxt.seq_lens_cpu is None) == (not host)
        v2.eagle_v2_catch_up(worker, nxt, lag)
        view = seen[0]
        results[host] = (new, view.extend_lens, view.prefix_lens, view.seq_lens.tolist(), view.seq_lens_cpu.tolist(),
                         view.input_ids.tolist(), view.out_cache_loc.tolist())
    assert results[False] == results[True]
    new, extend_lens, prefix_lens, seq_lens, seq_lens_cpu, input_ids, out_cache_loc = results[True]
    assert extend_lens == [1, 1, 1] and seq_lens == seq_lens_cpu == [p + 1 for p in prefix_lens]


# ----------------------------------------------------------------------------------------- finding 2
class _OneTokenGrammar:
    """A grammar allowing one token at a time: ``allowed[k]`` after ``k`` accepted tokens (SGLang's grammar
    object interface, as its sampler calls it)."""

    def __init__(self, allowed):
        from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

        BaseGrammarObject.__init__(self)
        self.allowed, self.accepted = allowed, []

    finished = False

    def is_terminated(self):
        return False

    def accept_token(self, token):
        self.accepted.append(token)

    def allocate_vocab_mask(self, vocab_size, batch_size, device):
        return torch.ones((batch_size, vocab_size), dtype=torch.bool)

    def fill_vocab_mask(self, vocab_mask, idx):
        vocab_mask[idx] = False
        vocab_mask[idx, self.allowed[len(self.accepted)]] = True

    @staticmethod
    def fill_vocab_mask_batched(entries, vocab_mask):
        for entry in entries:
            entry.grammar.fill_vocab_mask(vocab_mask, entry.row)

    @staticmethod
    def move_vocab_mask(vocab_mask, device):
        return vocab_mask.to(device)

    @staticmethod
    def apply_vocab_mask(logits, vocab_mask):
        logits.masked_fill_(~vocab_mask, float("-inf"))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_request_samples_what_its_grammar_allows(monkeypatch, overlap):
    """A structured-output request decoded by a plain step: SGLang's sampler masks by
    ``sampling_info.grammars``, which ForwardBatch.init_new sets (the plain step builds no ForwardBatch through
    it). Under overlap the previous step's token reaches the grammar through the scheduler's barrier, which
    must run before the mask is built (SGLang's verify calls it first), or the mask follows a stale state."""
    mr, reqs, alloc = R.world()
    rows = [0, 1]
    idx, lens, bonus = R.plain_step_inputs(mr, reqs, alloc, rows)
    grammar = _OneTokenGrammar(allowed=[5, 9])
    batch = R.spec_v2_batch(mr, idx, lens, bonus, reqs=reqs, has_grammar=True)
    batch.reqs[0].grammar = grammar
    barrier_calls = []

    def barrier():  # the scheduler's _advance_pending_grammar: the previous step's token into the FSM
        barrier_calls.append(len(grammar.accepted))
        if not grammar.accepted:
            grammar.accept_token(int(bonus[0]))

    if not overlap:
        grammar.accept_token(int(bonus[0]))  # without overlap the scheduler processed it already
    # SGLang's sampler all-reduces the tokens of a grammar batch over the TP group: one rank here, the identity.
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    res = v2.eagle_v2_plain_decode(R.spec_v2_worker(mr), batch, DraftLag(keep_hidden=None), None,
                                   barrier if overlap else None)
    assert res.next_token_ids.tolist()[0] == 9, "the token the grammar allows after the previous one"
    assert barrier_calls == ([0] if overlap else [])
    unconstrained = res.logits_output.next_token_logits[1].argmax().item()
    assert res.next_token_ids.tolist()[1] == unconstrained, "a request without a grammar is not masked"


def test_the_installed_switch_hands_the_grammar_barrier_to_the_plain_step(monkeypatch):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    if "grammar_barrier" not in inspect.signature(EAGLEWorkerV2.forward_batch_generation).parameters:
        pytest.skip("this SGLang (0.5.14) passes no grammar barrier: it syncs grammar batches instead")
    got = []
    monkeypatch.setattr(v2, "eagle_v2_plain_decode",
                        lambda worker, batch, lag, on_publish, barrier: got.append(barrier))
    v2.install_speculation_switch(4)
    worker = object.__new__(EAGLEWorkerV2)
    worker.speculative_num_steps, worker.activate_step_by_batch = 3, lambda bs: None
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, seq_lens=torch.zeros(8),
                            spec_info=object())
    barrier = object()
    EAGLEWorkerV2.forward_batch_generation(worker, batch, on_publish=None, grammar_barrier=barrier)
    EAGLEWorkerV2.forward_batch_generation(worker, batch, None, barrier)
    assert got == [barrier, barrier]


# ----------------------------------------------------------------------------------------- finding 6
def test_the_schedulers_barrier_gets_a_read_done_event_from_a_plain_step():
    """The overlap scheduler fences its next writes behind the read-done event of the worker's last reader of
    shared buffers (EAGLE: the draft runner's draft extend), else it waits for the whole forward and scheduling
    stops overlapping the GPU. A plain step runs no draft extend: the target's DECODE replay's event must reach
    the barrier. Oracle: SGLang's own Scheduler._apply_war_barrier."""
    from sglang.srt.managers.scheduler import Scheduler

    source = inspect.getsource(Scheduler._apply_war_barrier)
    event_name, reader = (("shared_read_done_event", "last_shared_read_runner") if "shared_read_done_event" in source
                          else ("war_fastpath_read_done_event", "war_fastpath_runner"))
    mr, reqs, alloc = R.world()
    setattr(mr, event_name, None)  # as ModelRunner.__init__ sets it
    draft = SimpleNamespace(**{event_name: None})
    idx, lens, bonus = R.plain_step_inputs(mr, reqs, alloc, [0, 1, 2])
    worker = R.spec_v2_worker(mr, **{reader: draft})
    res = v2.eagle_v2_plain_decode(worker, R.spec_v2_batch(mr, idx, lens, bonus, reqs=reqs), DraftLag(keep_hidden=None))
    assert res.can_run_cuda_graph
    waits = []
    stream = SimpleNamespace(wait_event=lambda ev: waits.append(("event", ev)),
                             wait_stream=lambda st: waits.append(("stream", st)))
    scheduler = SimpleNamespace(_war_barrier_enabled=True, model_worker=worker, schedule_stream=stream,
                                forward_stream=object())
    Scheduler._apply_war_barrier(scheduler)
    assert [kind for kind, _ in waits] == ["event"], "the fast path: the plain step's read-done event"
    assert getattr(draft, event_name) is None and getattr(mr, event_name) is None


# ----------------------------------------------------------------------------------------- finding 8
def test_catch_up_of_some_rows_through_sglangs_own_draft_prefill(monkeypatch):
    """The catch-up hands SGLang's real draft prefill (``_draft_extend_for_prefill`` -> ``ForwardBatch.init_new``)
    a batch of the lagging rows only, while the speculative batch around them asks for logprobs and tempers
    each row differently (rejection sampling). Every per-request field must be those rows' (SGLang reads the
    temperatures against the lagging rows' logits, the lengths' sum, the requests); the draft KV must equal a
    fresh draft prefill, the draft input of those rows must be rebuilt (``draft_probs`` included) and the other
    rows' left as they were."""
    from sglang.srt.speculative import eagle_worker_v2

    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    target = R.RunnerApiModelRunner(cfg, CPU, speculative=True)
    target.decode_cuda_graph_runner = MultiModeDecodeRunner(target)
    draft = R.RunnerApiModelRunner(cfg, CPU, speculative=False, model_seed=1, server_args=target.server_args)
    draft.req_to_token_pool = target.req_to_token_pool
    draft.attn_backend = H.TorchPagedAttention(cfg, target.req_to_token_pool, draft.token_to_kv_pool)
    # SGLang's own CPU choice of attention backend: positions computed by torch (Triton's CPU interpreter
    # cannot run SGLang's position kernel with NumPy 2)
    with contextlib.suppress(ValueError):  # 0.5.23 reads the runner's own string (and keeps its record sealed)
        _declare(target.server_args, attention_backend="torch_native")
    draft.is_draft_worker, draft.canary_manager, draft.prefill_attention_backend_str = True, None, "torch_native"
    draft.use_ngram_embedding = draft.model_is_mrope = False  # 0.5.14's ModelRunner keeps these itself
    draft.model_config.model_is_mrope = draft.model_config.requires_mm_token_modalities = False
    R.real_sampling(draft, 1)  # its ngram embedding manager, read by ForwardBatch.init_new
    try:  # 0.5.19+: init_new plans every batch's KV ids through the runner's translator (a pass-through here)
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        draft_flag = {"is_draft_worker": True}  # 0.5.22+ only
        if "is_draft_worker" not in inspect.signature(KVIndexTranslator.__init__).parameters:
            draft_flag = {}
        draft.kv_index_translator = KVIndexTranslator(
            req_to_token=draft.req_to_token_pool.req_to_token, token_to_kv_pool_allocator=None,
            token_to_kv_pool=draft.token_to_kv_pool, page_size=1, device="cpu", **draft_flag)
    except ImportError:
        pass
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=11)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(target, reqs, alloc)
    H.prefill(draft, reqs, None)
    logits = []
    forward = draft.model.forward
    draft.model.forward = lambda ids, pos, fb: logits.append(forward(ids, pos, fb)) or logits[-1]
    # Stand-in for one kernel: 0.5.23 draws through a Triton kernel that Triton's CPU interpreter cannot run
    # (NumPy 2); what is checked is the distribution the draw is made from.

    monkeypatch.setattr(eagle_worker_v2, "fast_sample", lambda probs, num_samples=1, **kw: probs.max(-1, keepdim=True))
    with _rejection_sampling(target):
        _catch_up_two_of_four_rows(cfg, target, draft, reqs, alloc, logits)


def _catch_up_two_of_four_rows(cfg, target, draft, reqs, alloc, logits):
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    lag, lagging, rows = DraftLag(keep_hidden=None), [0, 2], [0, 1, 2, 3]
    for _ in range(2):  # two plain steps of rows 0 and 2
        idx, lens, bonus = R.plain_step_inputs(target, reqs, alloc, lagging)
        res = v2.eagle_v2_plain_decode(R.spec_v2_worker(target), R.spec_v2_batch(target, idx, lens, bonus, reqs=reqs),
                                       lag)
        for r, t in zip(lagging, res.next_token_ids.tolist()):
            reqs.tokens[r].append(t)
    worker = R.spec_v2_worker(target, draft_worker=object.__new__(eagle_worker_v2.EagleDraftWorker))
    for name, value in dict(draft_runner=draft, speculative_algorithm=target.spec_algorithm, topk=1,
                            seed_dsa_topk_from_draft_extend=False, server_args=target.server_args).items():
        setattr(worker.draft_worker, name, value)
    idx = torch.tensor(rows)
    lens = torch.tensor([reqs.kv_len(r) for r in rows])
    temps = torch.tensor([[0.5], [1.0], [2.0], [4.0]])
    batch = R.spec_v2_batch(target, idx, lens, torch.tensor([reqs.tokens[r][-1] for r in rows]), reqs=reqs,
                            return_logprob=True, top_logprobs_nums=[2] * 4, token_ids_logprobs=[None] * 4,
                            extend_logprob_start_lens=[0] * 4, extend_num_tokens=99, orig_seq_lens=lens.clone())
    batch.sampling_info = R.real_sampling(target, 4, temperatures=temps)
    before = {name: getattr(batch.spec_info, name).clone() for name in ("topk_p", "topk_index")}
    batch.spec_info.draft_probs = torch.full((4, cfg.vocab), -1.0)
    v2.eagle_v2_catch_up(worker, batch, lag)

    probs = batch.spec_info.draft_probs
    want = torch.softmax(logits[-1].next_token_logits / temps[lagging], dim=-1)
    torch.testing.assert_close(probs[lagging].float(), want.float(), atol=1e-6, rtol=0)
    assert bool((probs[[1, 3]] == -1).all()), "rows that did not lag keep their draft input"
    for name, old in before.items():
        assert torch.equal(getattr(batch.spec_info, name)[[1, 3]], old[[1, 3]]), name
    assert isinstance(batch.spec_info, EagleDraftInput) and batch.seq_lens.tolist() == lens.tolist()
    # The oracle: the prompt's draft KV as the world's draft got it, then the lagging positions [5, 7) with
    # EAGLE's draft inputs (the token after each position, the bonus token last), run eagerly.
    fresh = R.RunnerApiModelRunner(cfg, CPU, speculative=False, model_seed=1, server_args=target.server_args)
    slots = H.SlotAllocator(cfg.kv_slots)
    for r in rows:
        n = reqs.kv_len(r)
        fresh.req_to_token_pool.req_to_token[r, :n] = slots.alloc(n, CPU).int()
    prompt = len(reqs.tokens[1]) - 1
    H.extend(fresh, rows, [0] * 4, [reqs.tokens[r][:prompt] for r in rows])
    H.extend(fresh, lagging, [prompt] * 2, [reqs.tokens[r][prompt + 1:] for r in lagging])
    for r in rows:
        n = reqs.kv_len(r)
        ours = draft.token_to_kv_pool.k_buffer[:, target.req_to_token_pool.req_to_token[r, :n].long()]
        theirs = fresh.token_to_kv_pool.k_buffer[:, fresh.req_to_token_pool.req_to_token[r, :n].long()]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=f"draft KV of request {r}")


def test_a_row_whose_lag_disagrees_with_the_batch_is_not_caught_up(caplog):
    """Positions kept on the device are not checked on the step path; the catch-up checks them against the
    batch's own lengths once per resume: a row that disagrees (reused unseen) is left out with a warning rather
    than written at another request's KV slots."""
    mr, reqs, alloc = R.world()
    idx, lens, bonus = R.plain_step_inputs(mr, reqs, alloc, [0, 1])
    lag = DraftLag(keep_hidden=False)
    lag.record([0, 1], lens)  # one plain step at lens: each lag ends at lens + 1
    batch = R.spec_v2_batch(mr, idx, torch.tensor([int(lens[0]) + 1, int(lens[1]) + 5]), bonus, reqs=reqs)
    seen = []
    worker = R.spec_v2_worker(mr, draft_worker=SimpleNamespace(
        _draft_extend_for_prefill=lambda view, hidden, tokens: seen.append(view.req_pool_indices.tolist())
        or SimpleNamespace()))
    with caplog.at_level(logging.WARNING, logger="graphpool"):
        v2.eagle_v2_catch_up(worker, batch, lag)
    assert seen == [[0]] and "row 1 lags up to" in caplog.text and len(lag) == 0


@contextlib.contextmanager
def _rejection_sampling(mr):
    """--speculative-use-rejection-sampling on, where this SGLang reads it: its runtime context's spec settings
    (0.5.17+), else ServerArgs (0.5.14)."""
    try:
        before = runtime_context.get_spec().speculative_use_rejection_sampling
    except (AttributeError, ValueError):  # no spec settings published in the runtime context
        before = None
    if before is None:
        before = mr.server_args.speculative_use_rejection_sampling
        mr.server_args.speculative_use_rejection_sampling = True
        try:
            yield
        finally:
            mr.server_args.speculative_use_rejection_sampling = before
        return
    context = runtime_context.get_context()
    context.override("graphpool-test", speculative_use_rejection_sampling=True)
    try:
        yield
    finally:
        context.override("graphpool-test", speculative_use_rejection_sampling=before)


# ----------------------------------------------------------------------------------------- finding 5
def test_graphs_write_their_logits_into_sglangs_shared_buffer():
    """SGLang's runners (0.5.17+) share one process-wide logits buffer per vocabulary
    (``model_runner.graph_shared_output``); a runner with its own costs ``max_bs x tokens x vocab x 4`` bytes
    more, again for every --speculative-adaptive state."""
    graph_shared_output = pytest.importorskip("sglang.srt.model_executor.graph_shared_output")
    mr, reqs, alloc = R.world(graphs=False)
    shared = graph_shared_output.GraphSharedOutput(device=CPU, max_rows=64)
    mr.graph_shared_output = shared
    first, second = MultiModeDecodeRunner(mr), MultiModeDecodeRunner(mr)  # e.g. two adaptive states' runners
    buffer = shared.get_logits_buffer(mr.cfg.vocab, rows=64)
    for runner in (first, second):
        assert runner.logits_buffer.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    for fb in first._capture_batches.values():  # where SGLang's logits processor writes each graph's logits
        assert fb.next_token_logits_buffer.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------------- finding 7
def test_the_replay_view_carries_every_field_of_sglangs():
    """What the attention backend plans a replay from: every field of SGLang's own ``build_replay_fb_view``
    (0.5.23 adds the unified pool's virtual ids and plan, the host length override, ...), per-batch ones equal."""
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as dcgr

    build = getattr(dcgr, "build_replay_fb_view", None)
    if build is None:
        pytest.skip("this SGLang's runner builds no replay view")
    mr, reqs, alloc = R.world()
    views = []
    plan = mr.attn_backend.init_forward_metadata_out_graph
    mr.attn_backend.init_forward_metadata_out_graph = lambda fb, in_capture=False: (views.append(fb),
                                                                                    plan(fb, in_capture))
    fb = H.decode_batch(mr, reqs, [0, 1, 2], alloc)
    sentinels = {}
    for name in ("max_seq_len_host", "kv_loc_cols", "out_cache_loc_virtual", "max_seq_len_override"):
        if hasattr(fb, name):
            sentinels[name] = object()
            setattr(fb, name, sentinels[name])
    assert mr.forward(fb).can_run_graph
    ours = views[-1]
    runner = mr.decode_cuda_graph_runner
    buffers = SimpleNamespace(**{name: runner._step.batch.inputs.get(name) for name in
                                 ("input_ids", "positions", "req_pool_indices", "seq_lens")},
                              seq_lens_cpu=runner.seq_lens_cpu, encoder_lens=None, mamba_track_indices=None)
    args = dict(forward_batch=fb, buffers=buffers, bs=4, raw_bs=3, num_tokens=4, seq_len_fill_value=1,
                capture_forward_mode=ForwardMode.DECODE, is_encoder_decoder=False, global_num_tokens_cpu=None)
    params = inspect.signature(build).parameters
    theirs = build(**{k: v for k, v in args.items() if k in params})
    missing = sorted(set(vars(theirs)) - set(vars(ours)))
    assert not missing, f"fields SGLang's replay view has and graphpool's lacks: {missing}"
    for name, value in sentinels.items():
        assert getattr(ours, name) is value, name


# ----------------------------------------------------------------------------------------- finding 6: backend
def test_backend_cleanup_releases_the_graphs_as_elastic_ep_asks():
    """Elastic EP's recapture calls ``decode_runner.backend.cleanup()`` (0.5.23's drop_elastic_cuda_graph_state)."""
    mr, reqs, alloc = R.world()
    runner = mr.decode_cuda_graph_runner
    try:
        from sglang.srt.model_executor.model_runner_components.cuda_graph_setup import drop_elastic_cuda_graph_state
    except ImportError:
        drop_elastic_cuda_graph_state = None
    if drop_elastic_cuda_graph_state is not None and "decode_runner" in inspect.signature(
            drop_elastic_cuda_graph_state).parameters:
        drop_elastic_cuda_graph_state(decode_runner=runner, eager_runner=mr.eager_runner)
    else:
        runner.backend.cleanup()
    assert runner.graphs == {} and not runner.pool.captured


# ----------------------------------------------------------------------------------------- findings 3 and 4
def _declare(server_args, **fields):
    """Record ``fields`` as this SGLang's resolution does: a declaration beside the raw input (0.5.23), its
    ``override`` onto the record (0.5.17), the fields themselves (0.5.14)."""
    if hasattr(server_args, "override"):
        server_args.override("graphpool-test", **fields)
        return
    try:
        from sglang.srt.arg_groups.overrides import declare_resolution
    except ImportError:
        declare_resolution = None
    if declare_resolution is not None:
        declare_resolution(server_args, "graphpool-test", **fields)
        return
    for name, value in fields.items():
        setattr(server_args, name, value)


def _server_args(*flags):
    return R.server_args_from_cli("--model-path", "dummy", "--device", "cpu", "--speculative-algorithm", "EAGLE",
                                  *flags)


def _stand_in(server_args, **config):
    """What unsupported_reasons reads of a dense EAGLE target ``ModelRunner`` of 0.5.17+ (mrope and ngram
    embedding live on its model_config only)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SimpleNamespace(server_args=server_args, model_config=SimpleNamespace(**config), hisparse_coordinator=None,
                           spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"))


def test_dp_attention_is_refused_by_the_flag_this_sglang_spells_it_with():
    spelled = ["--attn-dp-size", "2", "--tp-size", "2"]
    args = _server_args(*spelled)
    if args is None:  # 0.5.14 / 0.5.17: no --attn-dp-size yet
        spelled = ["--dp-size", "2", "--enable-dp-attention", "--tp-size", "2"]
        args = _server_args(*spelled)
    flag = "--attn-dp-size 2" if spelled[0] == "--attn-dp-size" else "--enable-dp-attention"
    assert f"DP attention ({flag})" in support.unsupported_reasons(_stand_in(args))
    with pytest.raises(SystemExit, match=flag):
        check_server_args(GraphpoolOptions(16, 12), args)


def test_lora_paths_alone_are_refused_as_lora():
    """SGLang turns LoRA on for --lora-paths without --enable-lora (0.5.23 declares it; the raw field stays None)."""
    args = _server_args("--lora-paths", "adapter=/nonexistent")
    assert "LoRA (--lora-paths)" in support.unsupported_reasons(_stand_in(args))
    with pytest.raises(SystemExit, match="--lora-paths"):
        check_server_args(GraphpoolOptions(16, 12), args)
    _declare(args, enable_lora=True)  # what SGLang's resolution decides for it
    assert any(reason.startswith("LoRA") for reason in support.unsupported_reasons(_stand_in(args)))
    assert not any(r.startswith("LoRA") for r in support.unsupported_reasons(_stand_in(_server_args())))


@pytest.mark.parametrize("attr, what", [("model_is_mrope", "mrope positions"),
                                        ("use_ngram_embedding", "ngram embedding")])
def test_model_features_kept_on_model_config_are_refused(attr, what):
    args = _server_args()
    assert what not in support.unsupported_reasons(_stand_in(args))
    assert what in support.unsupported_reasons(_stand_in(args, **{attr: True}))


def test_the_mamba_extra_buffer_is_refused_where_sglang_derives_it():
    args = _server_args("--mamba-radix-cache-strategy", "extra_buffer")
    assert "mamba state tracking" in support.unsupported_reasons(_stand_in(args))
    assert "mamba state tracking" not in support.unsupported_reasons(_stand_in(_server_args()))


@pytest.mark.parametrize("declared, name", [({"enable_multi_layer_eagle": True}, "--enable-multi-layer-eagle"),
                                            ({"speculative_algorithm": "FROZEN_KV_MTP"}, "FROZEN_KV_MTP")])
def test_workers_the_switch_does_not_drive_refuse_it_by_name(declared, name):
    """Multi-layer EAGLE and the frozen-KV MTP draft run on spec-v2 workers with their own
    forward_batch_generation: the switch would silently never act. SGLang may resolve them from a plain EAGLE
    launch (a model override turns multi-layer EAGLE on; a Gemma-4 assistant draft makes EAGLE FROZEN_KV_MTP)."""
    args = _server_args()
    check_server_args(GraphpoolOptions(16, 12), args)
    _declare(args, **declared)
    with pytest.raises(SystemExit, match=name):
        check_server_args(GraphpoolOptions(16, 12), args)
    with pytest.raises(SystemExit, match=name):
        check_server_args(GraphpoolOptions(adaptive_step0=True), args)


def test_the_switch_says_once_where_it_does_not_act(caplog):
    """Installed in a process of its own (no launcher to refuse), the switch logs once that a worker it does not
    drive runs, then lets SGLang's own body run; uninstall puts SGLang's method back."""
    from sglang.srt.speculative.multi_layer_eagle_worker_v2 import MultiLayerEagleWorkerV2

    own = MultiLayerEagleWorkerV2.forward_batch_generation
    v2.install_speculation_switch(4)
    with caplog.at_level(logging.WARNING, logger="graphpool"):
        for _ in range(2):
            with pytest.raises(AttributeError):  # SGLang's own body ran, on an empty stand-in
                MultiLayerEagleWorkerV2.forward_batch_generation(SimpleNamespace(), SimpleNamespace())
    warnings = [r.getMessage() for r in caplog.records if "MultiLayerEagleWorkerV2" in r.getMessage()]
    assert len(warnings) == 1 and "does not drive" in warnings[0]
    v2.uninstall_speculation_switch()
    assert MultiLayerEagleWorkerV2.forward_batch_generation is own


def test_a_standalone_draft_input_with_hidden_states_loses_rows_in_a_merge():
    """The SGLang fact behind the live tier's (d) on a GPU (``STANDALONE_GPU_ENV`` in tests/test_live_sglang.py):
    SGLang's draft-extend CUDA graph leaves a STANDALONE running batch with draft hidden states, where a STANDALONE
    prefill brings none; ``EagleDraftInput.merge_batch`` then keeps the running rows' hidden states alone, and the
    scheduler's next filter gathers rows that are not there (a device-side assert on an H100, run BN). EAGLE's
    prefills bring hidden states, so its merge keeps every row. Fails once SGLang merges such inputs row for row:
    then the live tier's draft-extend graphs can come back on for (d)."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    def draft_input(hidden):
        return EagleDraftInput(topk_p=torch.ones(1, 1), topk_index=torch.zeros(1, 1, dtype=torch.int64),
                               hidden_states=hidden, bonus_tokens=torch.zeros(1, dtype=torch.int32))

    def merged(running_hidden, prefill_hidden):
        running = draft_input(running_hidden)  # one request, which has finished
        for _ in range(2):  # two prefills join it before the scheduler filters the finished one out
            running.merge_batch(draft_input(prefill_hidden))
        return running

    # the scheduler's filter of a running batch: 0.5.14 tells it the batch was not filtered by the verify yet
    unfiltered = {"has_been_filtered": False} if "has_been_filtered" in inspect.signature(
        EagleDraftInput.filter_batch).parameters else {}
    eagle = merged(torch.zeros(1, 8), torch.zeros(1, 8))
    eagle.filter_batch(torch.tensor([1, 2]), **unfiltered)
    assert tuple(eagle.hidden_states.shape) == (2, 8) and eagle.topk_index.shape[0] == 2

    standalone = merged(torch.zeros(1, 8), None)  # a draft-extend graph's output, then STANDALONE prefills
    assert standalone.topk_index.shape[0] == 3 and tuple(standalone.hidden_states.shape) == (1, 8)
    with pytest.raises(IndexError):
        standalone.filter_batch(torch.tensor([1, 2]), **unfiltered)
