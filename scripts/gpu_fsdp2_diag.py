"""Where an FSDP2 step's GPU memory goes, with and without offloading (2 GPUs; the model of the FSDP2 budget test).

Per way (``keep``, ``all``: `offload_rank(policy="all")`, ``drain``: ``all`` with every store waited for
before the backward) and per step: the peak, and the memory allocated at every decoder layer's boundary --
after its forward, and when its backward starts (the gradient of its output arrives) -- plus what the
offloader says it moved.  Rank 0 prints one table per way; the numbers say whether offloading lowers the
forward's memory and where the backward's peak forms.

    PYTHONPATH=src:. python scripts/gpu_fsdp2_diag.py [--layers 3] [--hidden 512] [--steps 4]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
from typing import Any

import torch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from datapath.offload import offload_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    mb = 1 << 20

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                                       num_hidden_layers=args.layers, num_attention_heads=8, vocab_size=512,
                                       max_position_embeddings=args.seq, attention_dropout=0.1,
                                       attn_implementation="sdpa")
        m = transformers.LlamaForCausalLM(cfg).cuda()
        if world > 1:
            for layer in m.model.layers:
                fully_shard(layer)
            fully_shard(m)
        return m

    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randint(0, 512, (4, args.seq), generator=g).cuda() for _ in range(args.steps)]
    report: dict[str, Any] = {}
    for way in ("keep", "all", "drain"):
        gc.collect()  # the previous way's FSDP2 model (reference cycles)
        torch.cuda.empty_cache()
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        marks: list[tuple[str, float]] = []

        def fwd_hook(i: int) -> Any:
            def hook(mod: Any, inp: Any, out: Any) -> Any:
                marks.append((f"f{i}", torch.cuda.memory_allocated() / mb))
                t = out[0] if isinstance(out, tuple) else out
                if t.requires_grad:
                    t.register_hook(lambda grad: marks.append((f"b{i}", torch.cuda.memory_allocated() / mb)))
            return hook

        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(fwd_hook(i))
        ctx = offload_rank(model, policy="all", min_bytes=1 << 16) if way != "keep" else None
        steps = []
        cache = ctx.__enter__() if ctx is not None else None
        try:
            for i, ids in enumerate(data):
                opt.zero_grad(set_to_none=True)
                marks.clear()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated() / mb
                torch.cuda.reset_peak_memory_stats()
                with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                    torch.cuda.synchronize()
                    fwd_peak = torch.cuda.max_memory_allocated() / mb
                    if way == "drain" and cache is not None:
                        cache.wait_io()
                    after_fwd = torch.cuda.memory_allocated() / mb
                    loss.backward()
                torch.cuda.synchronize()
                steps.append({"base": round(base, 1), "fwd_peak": round(fwd_peak, 1),
                              "after_fwd": round(after_fwd, 1),
                              "peak": round(torch.cuda.max_memory_allocated() / mb, 1),
                              "marks": [(k, round(v, 1)) for k, v in marks]})
                opt.step()
            if cache is not None:
                st = cache.stats
                steps.append({"offloaded_MB": round(st.bytes_offloaded / mb, 1), "storages": st.storages_offloaded,
                              "loaded_MB": round(st.bytes_loaded / mb, 1)})
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        report[way] = steps
        del model, opt
        torch.cuda.empty_cache()
    if rank == 0:
        for way, steps in report.items():
            print(f"== {way}")
            for s in steps:
                print(json.dumps(s))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(args.world, _port(), args), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
