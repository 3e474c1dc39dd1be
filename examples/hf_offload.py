"""Train a Hugging Face causal LM with datapath's activation offloading, within a memory budget.

    python examples/hf_offload.py --tiny                        # CPU, a few seconds
    python examples/hf_offload.py --memory-budget 10GB          # GPU: Llama hidden 4096, 6 layers, fit 10 GB
    python examples/hf_offload.py --target ssd --path /nvme/act # everything offloaded to disk

The two lines that matter are marked ``# <--``: the model is built from a config (no
download), and the training loop runs inside ``offload(model, ...)``.  With a budget the
first steps are profiled; from then on every saved activation is kept, offloaded or
recomputed, whichever fits the budget fastest, and gradients stay bit-identical.
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

from datapath.offload import offload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--memory-budget", default=None, help="e.g. 10GB, 12GiB, 0.5 (of the GPU); default: none")
    ap.add_argument("--target", default="host", choices=("host", "ssd", "tiered"))
    ap.add_argument("--path", default=None, help="directory for --target ssd/tiered")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                                       num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
                                       use_cache=False)
        args.seq = min(args.seq, 64)
    else:
        cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=6,
                                       num_attention_heads=32, vocab_size=32000, max_position_embeddings=args.seq,
                                       use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)  # <--
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq), device=device)
    budget: str | float | None = args.memory_budget
    if budget is not None and budget.replace(".", "", 1).isdigit():
        budget = float(budget) if "." in budget else int(budget)
    # on a CPU, activations are CPU tensors: let them be offloaded too (normally they are kept)
    extra = {} if cuda else {"offload_cpu_tensors": True, "min_bytes": 4096}

    with offload(model, target=args.target, path=args.path, memory_budget=budget, **extra) as cache:  # <--
        for step, ids in enumerate(data):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            peak = f", peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB" if cuda else ""
            print(f"step {step}: loss {loss.item():.4f}, {(time.perf_counter() - t0) * 1e3:.0f} ms{peak}", flush=True)
        st = cache.stats
        print(f"offloaded {st.bytes_offloaded / 1e6:.1f} MB, loaded back {st.bytes_loaded / 1e6:.1f} MB")
        if cache.memory_budget is not None and cache.plan is not None:
            p = cache.plan
            print(f"plan for {cache.memory_budget / 1e9:.3g} GB: offload {p.offload_bytes / 1e6:.1f} MB per step, "
                  f"recompute blocks {list(p.recompute)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
