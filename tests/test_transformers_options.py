"""generate()'s options, inputs and outputs through the pool, against ``model.generate`` (the oracle).

A checkpoint's own ``generation_config`` is used (its repetition penalty changes the tokens as it does in
generate()); greedy-equivalent settings (penalties, min_new_tokens, an EOS list, max_length, top_k=1 sampling)
give generate()'s tokens in plain and prompt-lookup modes; stop strings end requests where generate() ends them;
streamers receive each request's tokens; log-probabilities equal generate()'s scores; tokenizer-shaped prompts
(left or right padded) are their unpadded tokens; options not served are errors naming them, and a refused
request leaves the generator usable."""
from __future__ import annotations

import copy

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, reference, tfm, tiny_model

pytestmark = needs_transformers

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [11, 12, 13], [3] * 11]
NEW = 12
PLAIN, LOOKUP = gp.SpeculationPolicy(off_above=0), None  # never speculate; speculate at every step


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def generator(model):
    return tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2, 4), num_draft_tokens=3)


def char_tokenizer():
    """A tokenizer of the tiny models' 96 tokens, one printable character each (token i is chr(32 + i))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = [chr(c) for c in range(32, 128)]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="~"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def both(generator, prompts=PROMPTS, **kw):
    return [generator.generate(prompts, policy=policy, **kw) for policy in (PLAIN, LOOKUP)]


def test_the_models_own_generation_config_is_used(model, generator):
    """A checkpoint's repetition_penalty in model.generation_config: generate() applies it, so does the pool."""
    own = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.repetition_penalty = 1.5
        want = reference(model, PROMPTS, [NEW] * 3, [])  # generate() reads the model's config too
        assert want != reference(model, PROMPTS, [NEW] * 3, [], repetition_penalty=1.0)  # the penalty matters
        for result in both(generator, max_new_tokens=NEW, eos_token_id=[]):
            assert result.tokens == want
        model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
        model.generation_config.top_p = 0.9
        options = tfm.options.resolve(model)
        assert options.do_sample and options.sampling[1:4] == (0.6, 50, 0.9)  # generate()'s top_k default too
        runs = {tuple(map(tuple, generator.generate(PROMPTS, max_new_tokens=NEW, seed=s).tokens)) for s in range(3)}
        assert len(runs) > 1  # sampled, as generate() would
    finally:
        model.generation_config = own


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, min_new_tokens=8, eos_token_id=None),
    dict(do_sample=True, top_k=1, temperature=0.7, repetition_penalty=1.3),  # sampling, greedy-equivalent
    dict(max_length=17),
], ids=["penalty", "min-new-tokens", "top-k-1", "max-length"])
def test_greedy_equivalent_settings_equal_generate(model, generator, options: dict):
    free = reference(model, PROMPTS, [NEW] * 3, [])
    eos = [free[1][3], free[2][2]]  # an EOS list that ends two requests early without min_new_tokens
    options = {**options, "eos_token_id": eos if "eos_token_id" in options or "max_length" in options else []}
    new = {} if "max_length" in options else {"max_new_tokens": NEW}
    want = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                             **{**new, **options, "eos_token_id": options["eos_token_id"] or None})
        want.append(out[0, len(prompt):].tolist())
    for result in both(generator, **new, **options):
        assert result.tokens == want, options
    if "min_new_tokens" in options:
        assert all(len(t) >= 8 for t in want) and any(t[-1] in eos for t in want)


def test_stop_strings_end_requests_where_generate_ends_them(model, generator):
    tokenizer = char_tokenizer()
    free = reference(model, PROMPTS, [NEW] * 3, [])
    stop = tokenizer.decode(free[0][4:6])  # two tokens' text: the first request stops at its 6th token
    want = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, stop_strings=[stop], tokenizer=tokenizer)
        want.append(out[0, len(prompt):].tolist())
    for result in both(generator, max_new_tokens=NEW, eos_token_id=[], stop_strings=stop, tokenizer=tokenizer):
        assert result.tokens == want and result.finish[0] == "stop_string" and len(want[0]) <= 6
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        generator.generate(PROMPTS, max_new_tokens=NEW, stop_strings=["x"])


def test_streamers_per_request_and_transformers_streamers(model, generator, capsys):
    from transformers import TextIteratorStreamer, TextStreamer

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended += 1

    recorders = [Recorder(), None, Recorder()]
    result = generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], streamer=recorders)
    for recorder, prompt, tokens in zip(recorders[::2], PROMPTS[::2], result.tokens[::2]):
        assert recorder.puts[0] == prompt and sum(recorder.puts[1:], []) == tokens and recorder.ended == 1
    tokenizer = char_tokenizer()
    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True)
    one = generator.generate([PROMPTS[0]], max_new_tokens=NEW, eos_token_id=[], streamer=iterator)
    assert "".join(iterator) == tokenizer.decode(one.tokens[0])
    generator.generate([PROMPTS[1]], max_new_tokens=NEW, eos_token_id=[], streamer=TextStreamer(tokenizer))
    assert tokenizer.decode(PROMPTS[1]) in capsys.readouterr().out
    with pytest.raises(ValueError, match="one streamer for 3 prompts"):
        generator.generate(PROMPTS, max_new_tokens=NEW, streamer=iterator)


def test_logprobs_equal_generates_scores(model, generator):
    ids = torch.tensor([PROMPTS[0]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         repetition_penalty=1.3, eos_token_id=None, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:]
    want = [score.log_softmax(-1)[0, t].item() for score, t in zip(out.scores, tokens)]
    for result in both(generator, prompts=[PROMPTS[0]], max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.3,
                       output_logprobs=True):
        assert result.tokens[0] == tokens.tolist()
        torch.testing.assert_close(torch.tensor(result.logprobs[0], dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
    assert generator.generate(PROMPTS, max_new_tokens=2).logprobs is None


def test_tokenizer_shaped_prompts_are_their_unpadded_tokens(model, generator):
    from transformers import BatchEncoding
    want = reference(model, PROMPTS, [NEW] * 3, [])
    longest = max(map(len, PROMPTS))
    pad = 95
    left = [[pad] * (longest - len(p)) + p for p in PROMPTS]
    right = [p + [pad] * (longest - len(p)) for p in PROMPTS]
    left_mask = [[0] * (longest - len(p)) + [1] * len(p) for p in PROMPTS]
    right_mask = [[1] * len(p) + [0] * (longest - len(p)) for p in PROMPTS]
    shapes = [BatchEncoding({"input_ids": torch.tensor(left), "attention_mask": torch.tensor(left_mask)}),
              BatchEncoding({"input_ids": right, "attention_mask": right_mask}),
              {"input_ids": torch.tensor(right), "attention_mask": torch.tensor(right_mask)}]
    for prompts in shapes:
        assert generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[]).tokens == want
    assert generator.generate(**shapes[0], max_new_tokens=NEW, eos_token_id=[]).tokens == want  # generate(**enc)
    # A tensor without a mask: generate()'s rule infers it from a pad token that is no EOS.
    assert generator.generate(torch.tensor(left), max_new_tokens=NEW, eos_token_id=[], pad_token_id=pad).tokens == want
    with pytest.raises(ValueError, match="not one run of ones"):
        generator.generate({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 0, 1]]}, max_new_tokens=2)
    with pytest.raises(ValueError, match="token_type_ids"):
        generator.generate({"input_ids": [[1, 2]], "token_type_ids": [[0, 0]]}, max_new_tokens=2)
    result = generator.generate(PROMPTS, max_new_tokens=[2, 4, 3], eos_token_id=[], pad_token_id=0)
    assert result.padded().tolist() == [t + [0] * (4 - len(t)) for t in result.tokens]


@pytest.mark.parametrize("options, named", [
    (dict(num_beams=2), "num_beams=2"), (dict(typical_p=0.5), "typical_p=0.5"),
    (dict(output_scores=True), "output_logprobs=True"), (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size=2"),
    (dict(stopping_criteria=[]), "unexpected keyword.*stopping_criteria"),
    (dict(logits_processor=[]), "unexpected keyword.*logits_processor"), (dict(foo=1), "unexpected keyword.*foo"),
])
def test_options_not_served_are_errors_naming_them(model, generator, options: dict, named: str):
    with pytest.raises(tfm.UnsupportedOptionError, match=named):
        generator.generate(PROMPTS, max_new_tokens=NEW, **options)
    assert generator.cache.free_slots == 4  # nothing half-done: the generator is as it was
    assert generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens == reference(
        model, PROMPTS, [NEW] * 3, [])


def test_a_models_own_unserved_option_is_named(model, generator):
    own = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.no_repeat_ngram_size = 3
        with pytest.raises(tfm.UnsupportedOptionError, match="no_repeat_ngram_size=3"):
            generator.generate(PROMPTS, max_new_tokens=NEW)
    finally:
        model.generation_config = own


def test_a_draft_generator_without_a_policy_speculates(generator):
    result = generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert result.steps_of("verify") and all(s.mode == "verify" for s in result.steps if s.drafted)


def test_cache_dtype_other_than_the_models(model):
    want = reference(model, PROMPTS, [NEW] * 3, [])
    wide = tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2), num_draft_tokens=2, cache_dtype=torch.float64)
    assert wide.cache.layers[0].keys.dtype == torch.float64
    assert wide.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens == want  # float32 keys kept exactly
    narrow = tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2), num_draft_tokens=2, cache_dtype=torch.bfloat16)
    assert [len(t) for t in narrow.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens] == [NEW] * 3
    with pytest.raises(TypeError, match="floating-point torch.dtype .* got torch.int8"):
        tfm.SlotCache(model, num_slots=2, max_len=8, dtype=torch.int8)


def test_a_generation_config_passed_and_a_mask_passed_apart(model, generator):
    from transformers import GenerationConfig
    want = reference(model, PROMPTS, [NEW] * 3, [], repetition_penalty=1.5)
    config = GenerationConfig(repetition_penalty=1.5, max_new_tokens=NEW, eos_token_id=[], do_sample=False)
    assert generator.generate(PROMPTS, config).tokens == want
    longest = max(map(len, PROMPTS))
    left = [[0] * (longest - len(p)) + p for p in PROMPTS]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in PROMPTS]
    assert generator.generate(left, config, attention_mask=mask).tokens == want
    with pytest.raises(TypeError, match="GenerationConfig"):
        generator.generate(PROMPTS, 12)


@pytest.mark.gpu
def test_options_and_sampling_with_cuda_graphs():
    """Real CUDA graphs: the processors, warpers and draws captured (sort, scatter, searchsorted), two windows."""
    model = tiny_model("gemma3", "cuda")
    want = reference(model, PROMPTS, [NEW] * 3, [], repetition_penalty=1.3)
    generator = tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2, 4), num_draft_tokens=3)
    for result in both(generator, max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.3):
        assert result.tokens == want and result.misses == 0
    sampled = [generator.generate(PROMPTS, max_new_tokens=NEW, do_sample=True, top_p=0.9, seed=0).tokens
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # the draws come from the seeded host generator
