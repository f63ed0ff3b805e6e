"""The runner-API adapter and the spec-v2 switch against what SGLang's own callers expect (0.5.14+).

Each test comes from a defect an independent review found, and fails without its fix. Oracles: eager
execution through SGLang's real ``ModelRunner._forward_raw``, SGLang's real ``ModelRunner.sample`` and
``Sampler``, the scheduler's real ``_normalize_decode_outputs``, and the signatures of this SGLang's
``EAGLEWorkerV2.forward_batch_generation`` and ``GenerationBatchResult``.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

import pytest
import torch

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)
from tests import sglang_harness as H

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from graphpool import UnknownModeError
from graphpool.integrations.sglang import spec_switch_v2 as v2
from graphpool.integrations.sglang.draft_lag import DraftLag

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()


_world, _plain_step_inputs, _spec_v2_batch, _worker = R.world, R.plain_step_inputs, R.spec_v2_batch, R.spec_v2_worker


# ----------------------------------------------------------------------------------------- the runner
def test_a_replay_keeps_the_output_fields_eager_execution_returns():
    """SGLang's execute keeps the model output's other fields (``dataclasses.replace``), slicing
    ``last_hidden_states`` too; a replay must return what eager execution returns."""
    def with_extras(forward):
        def run(input_ids, positions, fb):
            out = forward(input_ids, positions, fb)
            extra = {"last_hidden_states": out.hidden_states, "customized_info": {"tag": ["x"]}}
            names = {f.name for f in dataclasses.fields(LogitsProcessorOutput)}
            return dataclasses.replace(out, **{k: v for k, v in extra.items() if k in names})
        return run

    outputs = {}
    for graphs in (True, False):
        mr, reqs, alloc = _world(graphs=graphs, forward=with_extras)
        outputs[graphs] = mr.forward(H.decode_batch(mr, reqs, [0, 1, 2], alloc))
    got, want = outputs[True], outputs[False]
    assert got.can_run_graph and not want.can_run_graph
    for name in ("last_hidden_states", "customized_info"):
        expected = getattr(want.logits_output, name, None)
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(getattr(got.logits_output, name), expected, atol=1e-10, rtol=0)
        else:
            assert getattr(got.logits_output, name, None) == expected, name


def test_graphs_read_the_real_token_count_where_sglangs_do(monkeypatch):
    """Under expert parallelism (SGLang's ``enable_num_token_non_padded()``) SGLang's graphs read the batch's
    non-padded token count, so MoE layers mask padded rows: a replay padded 3 -> 4 shows the model 3."""
    monkeypatch.setattr(forward_batch_info, "enable_num_token_non_padded", lambda: True)
    seen = []

    def spy(forward):
        def run(input_ids, positions, fb):
            t = fb.num_token_non_padded
            seen.append(None if t is None else int(t.reshape(-1)[0]))
            return forward(input_ids, positions, fb)
        return run

    mr, reqs, alloc = _world(forward=spy)
    fb = H.decode_batch(mr, reqs, [0, 1, 2], alloc)
    fb.num_token_non_padded = torch.tensor([3], dtype=torch.int32)  # what ForwardBatch.init_new sets then
    seen.clear()
    out = mr.forward(fb)
    assert out.can_run_graph and mr.decode_cuda_graph_runner.bs == 4 and seen == [3]


def test_execute_of_a_mode_without_graphs_names_the_modes_it_holds():
    mr, reqs, alloc = _world()
    fb = H.decode_batch(mr, reqs, [0, 1], alloc)
    fb.forward_mode = ForwardMode.IDLE
    assert mr.decode_cuda_graph_runner.can_run_graph(fb) is False
    with pytest.raises(UnknownModeError, match=r"graphs for \['DECODE', 'TARGET_VERIFY'\], none for IDLE batches"):
        mr.decode_cuda_graph_runner.execute(fb)


# ----------------------------------------------------------------------------------------- the spec-v2 switch
class _ReachedSGLang(Exception):
    """Raised by the stub worker the moment SGLang's own forward_batch_generation body touches it."""


class _StubWorker:
    def __getattr__(self, name):
        raise _ReachedSGLang(name)


def test_the_installed_switch_calls_sglang_with_this_sglangs_own_signature():
    """0.5.14's ``forward_batch_generation(self, batch, on_publish=None)`` takes no ``grammar_barrier`` or
    ``pp_proxy_tensors``; 0.5.2x's does: a prefill step must reach SGLang's own body on either."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    prefill = SimpleNamespace(forward_mode=ForwardMode.EXTEND, is_extend_in_batch=False, reqs=[])
    v2.install_speculation_switch(16, 8)
    try:
        with pytest.raises(_ReachedSGLang):
            EAGLEWorkerV2.forward_batch_generation(_StubWorker(), prefill)
        with pytest.raises(_ReachedSGLang):
            EAGLEWorkerV2.forward_batch_generation(_StubWorker(), prefill, on_publish=None)
    finally:
        v2.uninstall_speculation_switch()


def test_a_plain_step_result_is_this_sglangs_generation_batch_result():
    mr, reqs, alloc = _world()
    idx, lens, bonus = _plain_step_inputs(mr, reqs, alloc, [0, 1, 2])
    res = v2.eagle_v2_plain_decode(_worker(mr), _spec_v2_batch(mr, idx, lens, bonus), DraftLag())
    assert res.can_run_cuda_graph and res.next_token_ids.shape == (3,)
    assert res.accept_lens.tolist() == [1, 1, 1] and res.new_seq_lens.tolist() == (lens + 1).tolist()


def test_a_plain_step_returns_the_logprobs_the_batch_asks_for():
    """The scheduler reads ``next_token_logprobs`` of every decode result of a batch with ``return_logprob``
    (``_normalize_decode_outputs``, real code): the plain step's result must carry them."""
    module = importlib.import_module("sglang.srt.managers.scheduler_components.batch_result_processor")
    processor = next((c for c in vars(module).values() if isinstance(c, type) and hasattr(c, "_normalize_decode_outputs")),
                     None) if module else None
    mr, reqs, alloc = _world()
    idx, lens, bonus = _plain_step_inputs(mr, reqs, alloc, [0, 1, 2])
    batch = _spec_v2_batch(mr, idx, lens, bonus, top_logprobs_nums=[0, 0, 0], token_ids_logprobs=[None] * 3,
                           spec_algorithm=mr.spec_algorithm)
    batch.return_logprob = True
    res = v2.eagle_v2_plain_decode(_worker(mr), batch, DraftLag())
    logprobs = res.logits_output.next_token_logprobs
    assert res.can_run_cuda_graph and logprobs is not None and logprobs.shape == (3,)
    want = torch.log_softmax(res.logits_output.next_token_logits.float(), -1).gather(1, res.next_token_ids[:, None])
    torch.testing.assert_close(logprobs.float(), want[:, 0], atol=1e-4, rtol=0)
    if processor is not None:
        scheduler = SimpleNamespace(_resolve_spec_v2_tokens=lambda result, b: [[t] for t in result.next_token_ids.tolist()])
        processor._normalize_decode_outputs(scheduler, batch=batch, result=res, logits_output=res.logits_output,
                                            next_token_ids=res.next_token_ids)


def test_an_eagle3_plain_step_carries_the_drafts_hidden_width():
    """EAGLE3's target returns 3 x hidden_size hidden states; the draft input carried between steps holds the
    draft's width. After a plain step the next draft input keeps it, and the catch-up writes into it."""
    def eagle3_target(forward):
        def run(input_ids, positions, fb):
            out = forward(input_ids, positions, fb)
            if out.hidden_states is not None:
                out.hidden_states = torch.cat([out.hidden_states] * 3, dim=-1)
            return out
        return run

    mr, reqs, alloc = _world(forward=eagle3_target)
    hidden, rows = mr.cfg.hidden, [0, 1, 2]
    idx, lens, bonus = _plain_step_inputs(mr, reqs, alloc, rows)
    batch = _spec_v2_batch(mr, idx, lens, bonus, draft_hidden=torch.zeros(3, hidden, dtype=mr.cfg.dtype))
    worker, lag = _worker(mr), DraftLag()
    res = v2.eagle_v2_plain_decode(worker, batch, lag)
    assert res.can_run_cuda_graph and res.next_draft_input.hidden_states.shape == (3, hidden)
    assert lag.take(rows)[0].hidden.shape == (1, 3 * hidden)  # the target's own width, for the catch-up
    lag.record(rows, lens.tolist(), res.logits_output.hidden_states)  # the take above consumed it
    new = res.next_token_ids.tolist()
    for r, t in zip(rows, new):
        reqs.tokens[r].append(t)
    step = _spec_v2_batch(mr, idx, lens + 1, res.next_draft_input.bonus_tokens, reqs=reqs,
                          spec_info=res.next_draft_input, sampling_info=batch.sampling_info)
    worker.draft_worker = SimpleNamespace(_draft_extend_for_prefill=lambda view, target_hidden, tokens: SimpleNamespace(
        topk_p=torch.ones(len(view.extend_lens), 1), topk_index=torch.zeros(len(view.extend_lens), 1, dtype=torch.int64),
        hidden_states=torch.ones(len(view.extend_lens), hidden, dtype=mr.cfg.dtype)))
    v2.eagle_v2_catch_up(worker, step, lag)
    assert bool((res.next_draft_input.hidden_states == 1).all())


def test_a_standalone_plain_step_runs_on_a_decode_graph_and_keeps_no_hidden_states():
    """A STANDALONE draft reads tokens only: DECODE graphs hold no hidden states, so a plain step must not ask
    for them (or it runs eagerly), and the switch's lag keeps positions only."""
    mr, reqs, alloc = _world(algorithm="STANDALONE")
    assert mr.decode_cuda_graph_runner.capture_hidden_modes[ForwardMode.DECODE] == CaptureHiddenMode.NULL
    idx, lens, bonus = _plain_step_inputs(mr, reqs, alloc, [0, 1, 2])
    fb = v2.plain_decode_batch(mr, req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.clone(), bonus_tokens=bonus)
    assert mr.forward(fb).can_run_graph
    idx, lens, bonus = _plain_step_inputs(mr, reqs, alloc, [3, 4])
    lag = DraftLag(keep_hidden=None)  # as install_speculation_switch builds it
    res = v2.eagle_v2_plain_decode(_worker(mr), _spec_v2_batch(mr, idx, lens, bonus), lag)
    assert res.can_run_cuda_graph and lag.keep_hidden is False


def test_replays_by_mode_and_eager_fallbacks_are_counted_for_the_server_log():
    """A live run reads "every step on a graph, no eager fallback" from the server log: the runner counts its
    replays by mode and each step it sends back to SGLang's eager path, once per step, by reason."""
    from bench.live import logs

    mr, reqs, alloc = _world()
    runner = mr.decode_cuda_graph_runner
    for rows in ([0, 1], [0, 1, 2]):
        assert mr.forward(H.decode_batch(mr, reqs, rows, alloc)).can_run_graph
    big = H.decode_batch(mr, reqs, [0, 1, 2, 3, 4], alloc)  # bs 5 > the largest captured, 4
    assert runner.can_run_graph(big) is False
    assert not mr.forward(big).can_run_graph  # _forward_raw asks again for the same batch: counted once
    facts = logs.parse(runner.replay_log.line())
    assert facts.replays == {"DECODE": 2} and facts.gp_fallbacks == "DECODE bs 5 > 4: 1"
