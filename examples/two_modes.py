"""Two step shapes ("modes") from one GraphPool: plain decode (1 token per sequence) and speculative
verify (4 tokens per sequence), chosen per step by batch size. CUDA graphs on a GPU, the pool's eager
twin on a CPU. Run: python examples/two_modes.py
"""
import torch

from graphpool import GraphPool, Mode, SpeculationPolicy, StepInput

device = "cuda" if torch.cuda.is_available() else "cpu"
DUMMY_SLOT = 0  # a KV-cache slot no sequence owns: padded rows write there


class TinyModel(torch.nn.Module):
    """Stands in for your model: embeds each token, writes it to its KV-cache slot, predicts the next."""

    def __init__(self, vocab: int = 256, hidden: int = 64, slots: int = 1024):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
        self.position, self.length = torch.nn.Embedding(512, hidden), torch.nn.Embedding(512, hidden)
        self.register_buffer("kv_cache", torch.zeros(slots, hidden))  # allocated once, before capture

    def forward(self, input_ids, positions, out_cache_loc, seq_lens, tokens_per_seq):
        per_token_len = seq_lens.repeat_interleave(tokens_per_seq, 0)  # per-sequence input -> token rows
        h = self.embed(input_ids) + self.position(positions) + self.length(per_token_len)
        self.kv_cache.index_copy_(0, out_cache_loc, h)
        logits = self.head(h)
        return {"logits": logits, "next_token": logits.argmax(-1)}


model = TinyModel().to(device)
pool = GraphPool(
    modes=[Mode("decode", tokens_per_seq=1), Mode("verify", tokens_per_seq=4)],
    inputs=[  # declared once: per-token inputs have bs * tokens_per_seq rows, per-sequence ones bs rows
        StepInput("input_ids", torch.int64, per="token"),
        StepInput("positions", torch.int64, per="token"),
        StepInput("out_cache_loc", torch.int64, per="token", fill=DUMMY_SLOT),
        StepInput("seq_lens", torch.int64, per="seq", fill=1),
    ],
    batch_sizes=[1, 2, 4, 8],
    device=device,
)


def step(batch):  # batch.mode, batch.bs (the padded size), batch.inputs: the static views a graph reads
    x = batch.inputs
    return model(x["input_ids"], x["positions"], x["out_cache_loc"], x["seq_lens"], batch.mode.tokens_per_seq)


def make_inputs(mode: Mode, bs: int) -> dict:
    """A step's real inputs: what your scheduler would hand over (random tokens here)."""
    tokens = bs * mode.tokens_per_seq
    seq_lens = torch.randint(8, 100, (bs,), device=device)
    offsets = torch.arange(tokens, device=device) % mode.tokens_per_seq
    positions = seq_lens.repeat_interleave(mode.tokens_per_seq) + offsets
    return {"input_ids": torch.randint(0, 256, (tokens,), device=device), "positions": positions,
            "out_cache_loc": torch.randperm(1023, device=device)[:tokens] + 1, "seq_lens": seq_lens}


with torch.inference_mode():
    # 8 graphs (2 modes x 4 sizes), largest token count first, one memory pool. `outputs` says which outputs
    # have one row per token (cut to the real rows on return); an undeclared output comes back whole.
    pool.capture(step, outputs={"logits": "token", "next_token": "token"})
    policy = SpeculationPolicy(off_above=4, on_at_or_below=2)  # speculate at <= 4 sequences, with hysteresis
    for bs in [1, 3, 6, 8, 5, 3, 2]:  # the batch size of each step of a decode loop
        mode = policy.choose(bs)
        out = pool.run(mode, copy=True, **make_inputs(pool.modes[mode], bs))  # copy: outlives the next run
        print(f"bs {bs}: {mode:<6} on graph bs={pool.route(mode, bs)}, next tokens {out['next_token'].tolist()}")
print(pool.stats.table())
print("per graph: capture ms, graph MiB (memory it added to the shared pool; 0 on the CPU twin), replays (steps "
      "it served), padded rows (rows of padding when fewer sequences than its bs came)")
