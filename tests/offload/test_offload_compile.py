"""compile=True (regional compilation, CPU inductor): each block compiled once per class, the offloader's hooks
outside the compiled regions; offloaded and recomputed compiled blocks (keeping their attention outputs or not)
give the gradients of the compiled model without offloading, dropout on."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _offload_models import assert_identical, cpu_keep_peak, run_steps
from datapath.offload import (
    OffloadConfigError, TensorCache, compile_blocks, offload, set_recompute, uncompile_blocks,
)

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 3, dropout: float = 0.1, seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                                   num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                   attention_dropout=dropout, attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def _compiled_reference(model: nn.Module, batches: list[torch.Tensor]) -> list:
    m = copy.deepcopy(model)
    compile_blocks(m)  # its blocks, its output head and its Hugging Face loss function
    assert "_loss_function" in m.__dict__ and "forward" in m.lm_head.__dict__
    try:
        return run_steps(m, batches, _loss)
    finally:
        uncompile_blocks(m)
        assert "_loss_function" not in m.__dict__ and "forward" not in m.lm_head.__dict__
        assert all("forward" not in b.__dict__ for b in m.model.layers)


@pytest.mark.slow
def test_offloaded_and_recomputed_compiled_blocks_are_bit_identical_to_the_compiled_model() -> None:
    """The budget's two tools on compiled blocks: offload (policy "all") and checkpointing around the compiled
    forward (what the plan switches on per block).  (A budget on the CPU measures with a dispatch mode, under
    which dynamo does not compile: the budget on compiled blocks is tested on the GPU.)"""
    model = _llama()
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(4)]
    ref = _compiled_reference(model, batches)
    eager = run_steps(copy.deepcopy(model), batches[:1], _loss)
    assert not torch.equal(eager[0][0], ref[0][0])  # the compiled blocks draw their own dropout masks: compiled
    cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True, compile=True)
    cache.attach(model)
    blocks = list(model.model.layers)
    assert all("forward" in b.__dict__ for b in blocks)  # compiled in place
    set_recompute(blocks, [0, 2])
    got = run_steps(model, batches, _loss, ctx=cache)
    assert_identical(ref, got)  # dropout on: the compiled graph's masks are replayed in recompute
    assert cache.stats.storages_offloaded > 0
    cache.close()
    assert all("forward" not in b.__dict__ for b in blocks)  # closing undid recompute and compile
    assert "forward" not in model.lm_head.__dict__


@pytest.mark.slow
def test_compile_with_policy_all_offloads_and_matches() -> None:
    model = _llama(2)
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(3)]
    ref = _compiled_reference(model, batches)
    with offload(model, min_bytes=1024, offload_cpu_tensors=True, compile={"dynamic": False}) as cache:
        got = run_steps(model, batches, _loss)
        assert cache.stats.storages_offloaded > 0
    assert_identical(ref, got)


@pytest.mark.parametrize("bad, match", [("yes", "compile must be"), ({"modes": "max"}, "unknown torch.compile")])
def test_bad_compile_option_is_named(bad: object, match: str) -> None:
    with pytest.raises(OffloadConfigError, match=match):
        TensorCache("host", compile=bad)


def test_compile_refuses_units_inside_blocks() -> None:
    model = _llama(2)
    cache = TensorCache("host", compile=True)
    with pytest.raises(OffloadConfigError, match="units='blocks'"):
        cache.attach(model, units="leaves")
    cache.close()
    assert all("forward" not in b.__dict__ for b in model.model.layers)


def test_a_block_with_its_own_forward_is_refused_before_any_block_changes() -> None:
    model = _llama(3)
    blocks = list(model.model.layers)
    blocks[2].forward = blocks[2].forward  # a wrapper someone installed on the instance
    with pytest.raises(OffloadConfigError, match="forward replaced"):
        compile_blocks(model)
    assert all("forward" not in b.__dict__ for b in blocks[:2]) and "_loss_function" not in model.__dict__
    assert "forward" not in model.lm_head.__dict__


class _TiedInside(nn.Module):
    """Blocks and a head that is one of the blocks' own modules (nothing to compile separately)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 7)

    def get_output_embeddings(self) -> nn.Module:
        return self.layers[2][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


@pytest.mark.slow
def test_output_head_compiled_only_outside_the_blocks() -> None:
    torch.manual_seed(3)
    m = _TiedInside()
    x = torch.randn(4, 16)
    want = m(x)
    assert compile_blocks(m) == 3  # the three blocks; the "head" lies inside block 2: not a region of its own
    assert "forward" not in m.layers[2][0].__dict__ and "forward" not in m.head.__dict__
    torch.testing.assert_close(m(x), want)
    uncompile_blocks(m)
    assert all("forward" not in b.__dict__ for b in m.layers)
    assert compile_blocks(list(m.layers[:2])) == 2  # a list: exactly those modules
    uncompile_blocks(list(m.layers[:2]))


@pytest.mark.slow
def test_output_head_matmuls_padded_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head is compiled with Inductor's shape padding forced, the blocks with the options as given; a mode
    (torch.compile takes no options with one), another backend or the user's own value: left as given.  (Each
    case uses options no other test compiles with, so every region is compiled afresh and seen here.)"""
    calls: list[tuple[object, dict]] = []
    real = torch.compile

    def spy(fn: object, **kw: object) -> object:
        calls.append((fn, kw))
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)

    def compiled_with(opts: dict) -> tuple[list[dict], list[dict]]:
        calls.clear()
        m = _llama(2)
        compile_blocks(m, opts)
        uncompile_blocks(m)
        layer = type(m.model.layers[0]).forward
        return ([kw for fn, kw in calls if fn is nn.Linear.forward], [kw for fn, kw in calls if fn is layer])

    opts = {"dynamic": False, "options": {"epilogue_fusion": True}}
    head, blocks = compiled_with(opts)
    assert head == [{"dynamic": False, "options": {"epilogue_fusion": True, "force_shape_pad": True}}]
    assert blocks == [opts]
    for given in ({"mode": "max-autotune-no-cudagraphs"}, {"backend": "aot_eager", "dynamic": False},
                  {"options": {"force_shape_pad": False, "epilogue_fusion": True}}):
        head, blocks = compiled_with(given)
        assert head == [given] and blocks == [given]


@pytest.mark.slow
def test_hf_output_head_compiled_and_restored() -> None:
    model = _llama(2).eval()  # no dropout: the compiled and eager logits must agree
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert compile_blocks(model) == 3  # two layers and the vocabulary projection
    assert "forward" in model.lm_head.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    uncompile_blocks(model)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_training_with_the_default_kv_cache_compiles_one_graph_for_every_layer(family: str) -> None:
    """Configs default to use_cache=True: a layer's cache update would make each layer compile its own graph (past
    the recompile limit, later layers fall back to eager).  Training calls run without the cache: one graph;
    a budget that recomputes blocks still matches the eager gradients; inference keeps its cache."""
    torch.manual_seed(11)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        fraction = 0.7  # of eager's peak: the compiled blocks save less, the loss's working set stays
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                                       num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg).train()
        fraction = 0.9
    assert cfg.use_cache
    batches = [torch.randint(0, 128, (8, 64)) for _ in range(6)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    torch._dynamo.reset()
    # one graph per block class, or this raises at the second layer
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        plain = copy.deepcopy(model)
        compile_blocks(plain)
        compiled = run_steps(plain, batches, _loss)
        uncompile_blocks(plain)
        with offload(model, memory_budget=int(fraction * cpu_keep_peak(model, _loss, batches[0])), compile=True, min_bytes=1024,
                     offload_cpu_tensors=True) as cache:
            got = run_steps(model, batches, _loss)
            assert cache.plan is not None and (cache.plan.recompute or cache.plan.offload_bytes)
    for (l1, g1), (l2, g2) in [*zip(ref, got), *zip(ref, compiled)]:  # compiled kernels: close to eager
        torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-5)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    compile_blocks(model)
    try:
        with torch.no_grad():
            out = model.eval()(input_ids=batches[0], use_cache=True)
        assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 64
    finally:
        uncompile_blocks(model)
        torch._dynamo.reset()


class _MaskedBlock(nn.Module):
    """A block whose boolean-mask indexing breaks the graph: that op runs eagerly inside the compiled model, and
    autograd calls the saved-tensor hooks from it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        picked = h[h > 0]  # data-dependent shape: a graph break
        return h * torch.sigmoid(h) + x + picked.sum()


@pytest.mark.slow
def test_whole_model_compile_never_traces_the_offloader() -> None:
    """torch.compile(model) around the offloader: the hooks run as plain Python (TorchDynamo compiled them, and what
    they call, when an eager op saved tensors: a crash in Inductor on a GPU Llama), and gradients still match."""
    from datapath.offload.cache import TensorCache as _Cache
    from datapath.offload.hooks import SavedTensorHooks
    torch.manual_seed(5)
    model = nn.Sequential(*[_MaskedBlock() for _ in range(3)])
    xs = [torch.randn(128, 64) for _ in range(4)]

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    torch._dynamo.reset()
    ref = run_steps(torch.compile(copy.deepcopy(model)), xs, loss)
    cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True)  # policy "all": every storage offloaded
    cache.attach(model)
    try:
        got = run_steps(torch.compile(model), xs, loss, ctx=cache)
        assert cache.stats.storages_offloaded > 0
    finally:
        cache.close()
    assert_identical(ref, got)
    get = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    for fn in (SavedTensorHooks.pack, SavedTensorHooks.unpack, _Cache.is_parameter):
        assert get(fn.__code__) == [], f"TorchDynamo compiled {fn.__qualname__}"
    torch._dynamo.reset()


def _llama_without_dropout(layers: int = 3) -> nn.Module:
    """The CPU's fused attention op (whose outputs a block may keep) runs only without attention dropout."""
    return _llama(layers, dropout=0.0, seed=11)


def _attention_forwards_in_backward(model: nn.Module, ids: torch.Tensor) -> int:
    """Calls of the CPU's fused attention forward while the backward of one step runs."""
    from torch.profiler import profile  # noqa: PLC0415

    loss = _loss(model, ids)
    with profile() as prof:
        loss.backward()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")


@pytest.mark.slow
def test_compiled_blocks_keeping_attention_match_the_compiled_model() -> None:
    """A compiled block recomputed with ``attention_saved`` runs its compiled region with the checkpoint inside it:
    gradients bit-identical to the compiled model's, its attention outputs saved tensors of the region that the
    offload store takes, and the attention forward not run again in the backward.  (With dropout it is refused:
    `test_compiled_blocks_with_dropout_refuse_to_keep_attention`.)"""
    model = _llama_without_dropout()
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(3)]
    ref = _compiled_reference(model, batches)
    offloaded = {}
    for saved in ([], [0, 2]):
        m = copy.deepcopy(model)
        cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True, compile=True, policy="all")
        cache.attach(m)
        set_recompute(list(m.model.layers), [0, 1, 2], attention_saved=saved)
        got = run_steps(m, batches, _loss, ctx=cache)
        assert_identical(ref, got)
        # queued: what the store was given (a storage the backward needs before its copy ends is handed back from
        # memory, so the bytes written depend on timing)
        offloaded[tuple(saved)] = cache.stats.bytes_queued
        assert _attention_forwards_in_backward(m, batches[0]) == 3 - len(saved)
        shapes: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (shapes.append(tuple(t.shape)), t)[1],
                                                      lambda t: t):
            _loss(m, batches[0])
        # each keeping block saves its attention output (batch x heads x seq x head_dim) and log-sum-exp
        assert shapes.count((4, 4, 32, 16)) == len(saved) and shapes.count((4, 4, 32)) == len(saved)
        cache.close()
    # and the store took them (less what the checkpoint around a block saves: its RNG state)
    assert offloaded[(0, 2)] - offloaded[()] > 2 * 4 * 4 * 32 * 16 * 4


def test_compiled_blocks_refuse_an_attention_store() -> None:
    """The attention store's dispatch mode would run a compiled region eagerly: compiled blocks keep their
    attention outputs as saved tensors instead, and asking for the store names them."""
    model = _llama_without_dropout(2)
    compile_blocks(model)
    blocks = list(model.model.layers)
    with pytest.raises(ValueError, match=r"blocks \[1\] are compiled.*attention_saved"):
        set_recompute(blocks, [0, 1], attention_offloaded=[1], attention_store=object())  # type: ignore[arg-type]
    uncompile_blocks(model)


@pytest.mark.parametrize("compile_,dropout", [(True, False), (False, False), (True, True)],
                         ids=["compiled", "eager", "compiled-dropout"])
def test_a_budget_tries_compiled_blocks_keeping_their_attention_with_everything_offloaded(compile_: bool,
                                                                                          dropout: bool) -> None:
    """Where a plan recomputes compiled blocks, the budget's trial also measures that recomputation with those
    blocks keeping their attention outputs (saved tensors of their compiled region) and every storage
    offloaded; eager blocks are planned from their probes instead, and blocks with dropout are left out (that
    other compiled graph would draw other masks).  (On the CPU the budget's memory meter keeps TorchDynamo from
    compiling: the blocks run their forwards eagerly, gradients bit-identical to the eager model's; B6 measures
    the compiled plan on the GPU.)"""
    from _offload_models import cpu_hf_checkpoint_peak  # noqa: PLC0415

    model = _llama(4, dropout=0.1) if dropout else _llama_without_dropout(4)
    batches = [torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(5)) for _ in range(10)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    budget = int(1.6 * cpu_hf_checkpoint_peak(model, _loss, batches[0]))
    cache = TensorCache("host", memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True, compile=compile_)
    cache.attach(model)
    got = run_steps(model, batches, _loss, ctx=cache)
    assert_identical(ref, got)
    tried = [p for r in cache.policy.trials for p in r["plans"]]
    keeping = [p for p in tried if p["attention_saved"] and p["cut_segment"] == max(q["cut_segment"] for q in tried)]
    cache.close()
    if compile_:  # the compiled blocks' plans recomputed blocks: the case arose
        assert any(p["recompute"] for p in tried), tried
    # never partitioned on the CPU: its meter (a dispatch mode) keeps the compiler from compiling, so a partitioned
    # block would run eagerly with no checkpoint, keeping everything (B6 measures partitioned plans on GPUs)
    assert all(p["partitioned"] == [] for p in tried), tried
    if not compile_ or dropout:
        assert keeping == [], keeping
        return
    assert keeping, tried
    for p in keeping:  # every recomputed (compiled) block keeps its attention outputs, and everything is offloaded
        assert p["attention_saved"] == p["recompute"] and p["cut_bytes"] == 0, p
        assert p["peak"] <= 1.03 * budget, (p["peak"], budget)


def test_dropout_is_found_in_the_blocks_people_train() -> None:
    """`draws_dropout`: Hugging Face attention modules hold their dropout as a float, GPT-2 and PyTorch's layers as
    ``nn.Dropout`` modules; nothing is drawn with p = 0 or in eval mode."""
    from datapath.offload.recompute import draws_dropout  # noqa: PLC0415

    assert draws_dropout(_llama(1, dropout=0.1).model.layers[0])
    assert not draws_dropout(_llama_without_dropout(1).model.layers[0])
    assert not draws_dropout(_llama(1, dropout=0.1).eval().model.layers[0])
    for p in (0.0, 0.1):
        cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, resid_pdrop=p, attn_pdrop=p, embd_pdrop=p)
        assert draws_dropout(transformers.GPT2LMHeadModel(cfg).train().transformer.h[0]) == (p > 0)
    assert draws_dropout(nn.TransformerEncoderLayer(64, 4, dropout=0.1))
    assert not draws_dropout(nn.TransformerEncoderLayer(64, 4, dropout=0.0))


def test_lora_dropout_is_dropout() -> None:
    """peft's LoRA adapters draw their own dropout inside the attention's projections (``lora_dropout``)."""
    from datapath.offload.recompute import draws_dropout  # noqa: PLC0415

    peft = pytest.importorskip("peft")  # not in the test extras: runs where it is installed
    for p in (0.0, 0.05):
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=p, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(_llama_without_dropout(1), lora).train()
        assert draws_dropout(model.base_model.model.model.layers[0]) == (p > 0)


class _DropoutBlock(nn.Module):
    """Attention (what a keeping block saves) and a dropout whose mask the gradient of ``w`` shows: for
    ``y = dropout(h) * w`` and a loss ``sum(y * g)``, ``w.grad == sum(g * y / w)`` exactly when the backward used
    the forward's mask."""

    def __init__(self, width: int = 32, heads: int = 4, p: float = 0.3) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)
        self.w = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o(a.transpose(1, 2).reshape(b, s, w))
        return torch.nn.functional.dropout(h, self.p, self.training) * self.w


@pytest.mark.slow
@pytest.mark.parametrize("fallback", [False, True], ids=["compiled", "eager-fallback"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_blocks_keeping_attention_backpropagate_their_own_dropout_masks(device: str,
                                                                                 fallback: bool) -> None:
    """A compiled block recomputed keeping its attention outputs, with a dropout the refusal cannot see (a
    functional call), backpropagates the dropout masks its forward drew, or refuses with `OffloadConfigError`:
    never other masks.  Compiled, its random ops are saved (a random op recomputed inside a compiled region draws
    anew on the GPU); on the GPU torch's partitioner rejects that, which must reach the user as the clear error.
    Where the region runs eagerly after all (TorchDynamo's fallback, here the compiler disabled), the eager policy
    recomputes them from the replayed RNG state (saving an in-place draw raised there: the checkpoint's cached
    tensor was mutated).  Checked through ``w.grad == sum(g * y / w)`` on every block (`_DropoutBlock`)."""
    torch.manual_seed(3)
    blocks = nn.Sequential(*[_DropoutBlock() for _ in range(3)]).to(device).train()
    compile_blocks(list(blocks))
    set_recompute(list(blocks), [0, 1, 2], attention_saved=[0, 1, 2])
    x = torch.randn(2, 16, 32, device=device)
    outs: list[torch.Tensor] = []
    h = x
    try:
        with torch._dynamo.config.patch(disable=fallback):
            for blk in blocks:
                h = blk(h)
                h.retain_grad()
                outs.append(h)
            g = torch.randn_like(h)
            (h * g).sum().backward()
    except OffloadConfigError as e:
        assert device == "cuda" and not fallback, f"refused where it runs: {e}"
        assert "dropout" in str(e) and "attention_saved" in str(e)
        uncompile_blocks(list(blocks))
        return
    for i, (blk, y) in enumerate(zip(blocks, outs)):
        assert y.grad is not None
        expect = (y.grad * y / blk.w).sum(dim=(0, 1))  # the gradient reaching y times the masked input of ``* w``
        assert torch.allclose(blk.w.grad, expect, rtol=1e-4, atol=1e-5), f"block {i}: the backward drew other masks"
    assert (outs[0] == 0).any()  # dropout did drop
    uncompile_blocks(list(blocks))


@pytest.mark.parametrize("when", ["training", "trained-later"])
def test_compiled_blocks_with_dropout_refuse_to_keep_attention(when: str) -> None:
    """A compiled block with dropout (here a Hugging Face attention's ``attention_dropout``) asked to keep its
    attention outputs in its compiled region is refused with `OffloadConfigError` naming the fix: at
    `set_recompute` in training mode; at its first training forward when it was set in eval mode (no dropout
    then) and trains later.  Plain recomputation and inference stay allowed."""
    model = _llama(2, dropout=0.1).train()
    blocks = list(model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    compile_blocks(blocks)
    if when == "training":
        with pytest.raises(OffloadConfigError, match=r"blocks \[0, 1\] are compiled with dropout on"):
            set_recompute(blocks, [0, 1], attention_saved=[0, 1])
        set_recompute(blocks, [0, 1])  # plain recomputation of compiled blocks stays allowed
    else:
        model.eval()
        set_recompute(blocks, [0, 1], attention_saved=[0, 1])
        with torch.no_grad():
            model(ids)  # inference keeps nothing: no refusal
        model.train()
        with pytest.raises(OffloadConfigError, match="LlamaDecoderLayer block is compiled with dropout on"):
            model(ids, labels=ids)
    set_recompute(blocks, ())
    uncompile_blocks(blocks)
