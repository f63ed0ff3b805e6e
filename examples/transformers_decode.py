"""A Hugging Face transformers model's decode steps from one GraphPool: plain decode and prompt-lookup
speculation (drafts from each sequence's own history, no draft model), chosen per step. CUDA graphs on a
GPU, the pool's eager twin on a CPU. Random weights from a config, so it runs anywhere without downloads;
a real checkpoint works the same (AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa")).
Run: python examples/transformers_decode.py
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import graphpool as gp
from graphpool.integrations.transformers import PoolGenerator

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
model = LlamaForCausalLM(config).to(device).eval()

# One slot-indexed KV cache (8 sequences of up to 96 tokens) and graphs for decode (1 token per row) and
# verify (1 + 4 drafts per row) at batch sizes 1, 2, 4, 8: allocated and captured here, once.
generator = PoolGenerator(model, max_len=96, batch_sizes=[1, 2, 4, 8], num_draft_tokens=4)
prompts = [[10, 11, 12, 13, 10, 11, 12, 13, 10], [7, 8, 9], [42] * 5, [1, 2, 3, 4, 5, 6, 1, 2, 3]]
result = generator.generate(
    prompts, max_new_tokens=[24, 40, 16, 32], eos_token_id=[],   # requests end at their own steps
    policy=gp.SpeculationPolicy(off_above=2),                    # look up drafts once <= 2 requests run
    gate=gp.AcceptanceGate(min_accept=1.3, window=4))            # and only while they pay
for prompt, tokens in zip(prompts, result.tokens):
    print(f"prompt {prompt} -> {tokens}")
print(result.summary())
print(generator.pool.stats.table())
