"""Debug aid (GPU): a torch.compile'd small HF Llama under memory_budget, the budget policy's state per step."""
from __future__ import annotations

import logging

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from datapath.offload import TensorCache

logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
logging.getLogger("datapath.offload.budget").setLevel(logging.INFO)
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=3, num_attention_heads=8,
                               num_key_value_heads=4, max_position_embeddings=256, attention_dropout=0.1,
                               vocab_size=512, attn_implementation="sdpa", use_cache=False)
model = transformers.LlamaForCausalLM(cfg).cuda().train()
g = torch.Generator(device="cuda").manual_seed(3)
batches = [torch.randint(0, 512, (4, 256), device="cuda", generator=g) for _ in range(6)]
budget = int(torch.cuda.memory_allocated() * 3)
cache = TensorCache("host", memory_budget=budget, min_bytes=1 << 16)
cache.attach(model)
cm = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
pol = cache.policy
for i, ids in enumerate(batches):
    opt.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", dtype=torch.bfloat16), cache:
        loss = cm(input_ids=ids, labels=ids).loss
        rec = cache.scopes.record
        print(f"step {i} fwd: rec {rec.rid if rec else None} segs {len(rec.segments) if rec else 0} units "
              f"{rec.units if rec else 0} packs {cache.stats.packs} offloaded {cache.stats.storages_offloaded} "
              f"profiling {rec.profiling if rec else None} timing {rec.timing if rec else None}", flush=True)
        loss.backward()
    opt.step()
    print(f"step {i} bwd: started {rec.backward_started if rec else None} end_queued {rec.end_queued if rec else None}"
          f" bwd_done {rec.bwd_done if rec else None} peaks {pol.peaks} plan {pol.plan is not None} "
          f"_profiling {pol._profiling is not None} _memory {pol._memory is not None} _timing {pol._timing is not None}"
          f" want_timing {pol._want_timing} records {cache.stats.records}", flush=True)
cache.close()
