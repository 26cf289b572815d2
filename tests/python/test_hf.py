"""flash_msa.hf.convert on tiny random models of each supported transformers family: logits
and gradients equal the original model's where MSA is dense, the proxy trains through the KL."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.25.0")  # flash_msa.hf's

import flash_msa  # noqa: E402
from conftest import check_rule, max_err  # noqa: E402

hf = flash_msa.hf

B, S = 2, 300  # three 128-token blocks, the last one partial
DENSE_TOP_K = 384  # every block
VOCAB = 97


def family_config(family: str):
    """A two-layer config of the family with its particular features: its own head_dim (unlike
    hidden_size / heads), rope scaling (llama3 on Llama, yarn with its attention factor on
    Qwen2), Qwen3's q/k norms, Qwen2's q/k/v biases, Mistral's sliding window (longer than S)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024, initializer_range=0.2)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=128))
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=512)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=256))
    return transformers.Qwen3Config(**common)


MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FAMILIES = list(MODEL_CLASSES)


def make_model(family: str, seed: int = 70):
    """The original model in float32 with eager attention; its biases (zero at init) random so
    that Qwen2's q/k/v biases count. head_dim 64 (not hidden_size / heads = 16): its scale 1/8
    is exact in float32, the type of the ops' scale, so that float64 agrees to rounding; and
    the CUDA kernels take it."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family])(family_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(std=0.5)
    model.set_attn_implementation("eager")
    return model.eval()


def float64(model):
    """The float64 reference: the original model in float64 with SDPA attention, float64
    throughout (eager attention takes its softmax in float32 whatever the dtype)."""
    model = copy.deepcopy(model).double()
    model.set_attn_implementation("sdpa")
    return model


def tokens(seed: int = 71, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, S), generator=g).to(device)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def converted(model, **kw):
    kw.setdefault("top_k", DENSE_TOP_K)
    return hf.convert(copy.deepcopy(model), proxy_heads=2, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_logits_equal_the_original_where_msa_is_dense(family, mode):
    """Sparse with top_k covering every block, and warmup (whatever top_k): the original's
    logits within the spec's rule (float32 against the float64 original, twice the error of
    the float32 original); in float64 to 1e-10. top_k = 128 (sparse) does change them."""
    model = make_model(family)
    ids = tokens()
    ref64 = logits(float64(model), ids)
    baseline = logits(model, ids)
    warmup = mode == "warmup"
    msa = converted(model, top_k=DENSE_TOP_K if not warmup else 128, warmup=warmup)
    assert msa.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    check_rule(f"{family} {mode} logits", logits(msa, ids), ref64, baseline, atol=1e-5)
    assert max_err(logits(msa.double(), ids), ref64) <= 1e-10
    if not warmup:
        hf.set_warmup(msa, False)
        msa.config.msa["top_k"] = 128
        assert max_err(logits(msa, ids), ref64) > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_autocast_runs_the_ops_in_the_autocast_dtype(family):
    """Under autocast the model's RoPE hands the attention fp32 q/k beside bf16 v: a converted
    model runs (the ops take one dtype) and matches the original under the same autocast to
    the rule, with the proxy trained through the KL."""
    model = make_model(family)
    ids = tokens()
    ref64 = logits(float64(model), ids)
    msa = converted(model, kl_weight=1.0).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        baseline = logits(model, ids)
        out = msa(ids, labels=ids, use_cache=False)
    check_rule(f"{family} autocast logits", out.logits.detach(), ref64, baseline, atol=1e-5)
    out.loss.backward()
    proxy = msa.model.layers[0].self_attn.q_proxy_proj.weight.grad
    assert proxy is not None and proxy.abs().max() > 0
    assert torch.isfinite(hf.kl_value(msa))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_main_weights_as_the_original_proxy_through_the_kl(family):
    """float64, dense top_k: the loss plus the KL terms gives the model's own weights the
    original model's gradients and the proxy projections nonzero ones; the language-model loss
    alone (kl_weight=0) gives the proxy none. The backward writes each layer's KL value."""
    model = make_model(family)
    ids = tokens()
    original = float64(model)
    original(ids, labels=ids, use_cache=False).loss.backward()
    want = {n: p.grad for n, p in original.named_parameters()}

    msa = converted(model.double(), kl_weight=0.0)
    out = msa(ids, labels=ids, use_cache=False)
    out.loss.backward(retain_graph=True)
    proxy = [n for n, _ in msa.named_parameters() if "proxy" in n]
    assert len(proxy) == 2 * 2 * (2 if family == "qwen2" else 1)  # q and k, weight (and bias)
    assert all(p.grad is None for n, p in msa.named_parameters() if n in proxy)
    msa.zero_grad()
    (out.loss + hf.kl_loss(msa)).backward()
    for name, p in msa.named_parameters():
        if name in proxy:
            assert p.grad.abs().max() > 0, name
        else:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12, msg=name)
    for layer in msa.model.layers:
        value = layer.self_attn.msa_kl_value
        assert value.dtype == torch.float64 and torch.isfinite(value) and value > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_a_proxy_that_copies_the_main_projections_has_kl_zero(family, mode):
    """One proxy head per query head, each a copy of the model's q/k projections (biases
    included): the proxy attention is then the main attention if and only if the proxy gets the
    model's RoPE (llama3 and yarn scaling included), its heads and its scale, and the KL value
    the backward writes is 0. (Qwen3's q/k norms act on the main branch only.)"""
    model = make_model(family).double()
    msa = hf.convert(model, top_k=DENSE_TOP_K, proxy_heads=4, proxy_kv_heads=2,
                     warmup=mode == "warmup")
    with torch.no_grad():
        for layer in msa.model.layers:
            attn = layer.self_attn
            for proxy, main in ((attn.q_proxy_proj, attn.q_proj), (attn.k_proxy_proj, attn.k_proj)):
                proxy.load_state_dict(main.state_dict())
    ids = tokens()
    (msa(ids, labels=ids, use_cache=False).loss + hf.kl_loss(msa)).backward()
    for layer in msa.model.layers:
        assert abs(layer.self_attn.msa_kl_value.item()) <= 1e-10


def test_only_the_named_layers_are_converted():
    model = make_model("llama").double()
    ids = tokens()
    ref = logits(float64(model), ids)
    msa = converted(model, top_k=128, layers=[1])
    attn = [layer.self_attn for layer in msa.model.layers]
    assert not hasattr(attn[0], "q_proxy_proj") and hasattr(attn[1], "q_proxy_proj")
    assert msa.config.msa == dict(top_k=128, proxy_heads=2, proxy_kv_heads=1, layers=[1],
                                  warmup=False, kl_weight=1.0)
    assert type(msa.config).from_dict(msa.config.to_dict()).msa == msa.config.msa  # saved
    assert max_err(logits(msa, ids), ref) > 1e-3  # layer 1 is sparse at top_k = 128
    # Layer 1 alone, dense: the original logits (layer 0 runs SDPA, causal without a mask).
    hf.set_warmup(msa, True)
    assert max_err(logits(msa, ids), ref) <= 1e-10
    assert hf.kl_loss(msa).dim() == 0 and not hasattr(attn[0], "_msa_kl")


def test_unknown_architecture_is_rejected():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1,
                                     n_head=2)
    with pytest.raises(ValueError, match="flash_msa: .*llama, mistral, qwen2, qwen3 families.*"
                                         "GPT2LMHeadModel.*'gpt2'"):
        hf.convert(transformers.GPT2LMHeadModel(config), top_k=128)
    with pytest.raises(ValueError, match="flash_msa: hf.convert: model: expected a transformers"):
        hf.convert(torch.nn.Linear(2, 2), top_k=128)


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=100), "top_k: expected a positive multiple of 128"),
    (dict(proxy_heads=3), "proxy_heads: expected a divisor of the model's 4"),
    (dict(proxy_heads=2, proxy_kv_heads=4), "proxy_kv_heads: expected a divisor of proxy_heads"),
    (dict(layers=[2]), r"layers: expected None or distinct layer indices in \[0, 2\)"),
    (dict(layers=[1, 1]), "layers: expected None or distinct"),
    (dict(warmup=1), "warmup: expected a bool"),
    (dict(kl_weight=-0.1), "kl_weight: expected a finite number >= 0, got -0.1"),
    (dict(kl_weight=float("nan")), "kl_weight: expected a finite number >= 0"),
])
def test_convert_argument_errors(kw, match):
    kw = {"top_k": 128, **kw}
    with pytest.raises(ValueError, match=f"flash_msa: hf.convert: {match}"):
        hf.convert(make_model("qwen3"), **kw)


def test_an_older_transformers_is_refused():
    with pytest.raises(ImportError,
                       match="flash_msa.hf: expected transformers >= 5.25.0, got 5.17.0"):
        hf._check_transformers("5.17.0")
    hf._check_transformers(hf.MIN_TRANSFORMERS)
    hf._check_transformers("6.0.0")


def test_what_the_converted_attention_rejects():
    msa = converted(make_model("mistral"))
    ids = tokens()
    with pytest.raises(ValueError, match="hf.convert: model: expected a model that is not"):
        hf.convert(msa, top_k=128)
    padded = torch.ones_like(ids)
    padded[0, :5] = 0
    with pytest.raises(ValueError, match="flash_msa: attention_mask: expected no padding"):
        msa(ids, attention_mask=padded, use_cache=False)
    past = msa(ids[:, :-1], use_cache=True).past_key_values
    msa(ids, use_cache=False)  # another sequence: its proxy keys replace the cached ones
    with pytest.raises(ValueError, match="flash_msa: cache: expected the proxy keys of the 299 "
                                         "cached tokens of a batch of 2 .*got none"):
        msa(ids[:, -1:], cache=past, use_cache=True)
    with pytest.raises(ValueError, match="flash_msa: hf.kl_loss: model: expected a model "
                                         "converted"):
        hf.kl_loss(make_model("llama"))
    with pytest.raises(ValueError, match="flash_msa: hf.kl_loss: model: expected a forward"):
        hf.kl_loss(converted(make_model("llama")))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_save_and_load_give_identical_logits(family, mode, tmp_path):
    """save_pretrained keeps the proxy weights and config.msa; hf.from_pretrained converts the
    loaded model again, warmup flag and converted layers included, and loads every weight:
    bitwise the same logits. (At top_k = 256 the queries of the last block of S = 300 select
    one of the two others: the proxy weights count.)"""
    msa = converted(make_model(family), top_k=256, layers=[1], warmup=mode == "warmup")
    msa.save_pretrained(tmp_path)
    loaded, info = hf.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(loaded) is type(msa)
    assert loaded.config.msa == msa.config.msa
    assert loaded.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    ids = tokens()
    assert torch.equal(logits(loaded, ids), logits(msa, ids))
    other = "sparse" if mode == "warmup" else "warmup"
    hf.set_warmup(msa, other == "warmup")
    hf.set_warmup(loaded, other == "warmup")
    assert torch.equal(logits(loaded, ids), logits(msa, ids))


def test_from_pretrained_takes_transformers_arguments_and_rejects_plain_models(tmp_path):
    msa = converted(make_model("llama"), top_k=256)
    msa.save_pretrained(tmp_path / "msa")
    loaded = hf.from_pretrained(tmp_path / "msa", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in loaded.parameters())
    ids = tokens()
    assert torch.equal(logits(loaded, ids), logits(msa.double(), ids))
    make_model("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="flash_msa: hf.from_pretrained: path: expected a model "
                                         "saved after flash_msa.hf.convert .*whose config has "
                                         "none"):
        hf.from_pretrained(tmp_path / "plain")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    gpt2.config.msa = dict(top_k=128)
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="flash_msa: hf.from_pretrained: path: expected a model "
                                         "of the llama, mistral, qwen2, qwen3 families.*'gpt2'"):
        hf.from_pretrained(tmp_path / "gpt2")


def generate(model, ids, new):
    """Greedy generate() with the KV cache: the tokens and the logits of each step. No end of
    sequence, so that every row runs all steps."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


def greedy_reference(model, ids, new):
    """MSA decoding the straightforward way: each step a forward over the whole sequence without
    a cache (every query selects its blocks among all the keys), then the argmax."""
    steps = []
    for _ in range(new):
        step = logits(model, ids)[:, -1]
        steps.append(step)
        ids = torch.cat([ids, step.argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(steps, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_the_cache_decodes_as_whole_forwards(family):
    """370 prompt tokens, 20 new ones crossing the block boundary at 384, top_k = 256: each new
    token attends to its own block and one of two or three earlier ones, chosen by the proxy
    among all the cached keys. generate() with the cache gives the tokens of whole forwards
    without it, its logits to rounding, and sparsity changes them (against top_k = 512)."""
    msa = converted(make_model(family), top_k=256)
    ids = tokens()[:, :370]
    want, want_logits = greedy_reference(msa, ids, 20)
    got, got_logits = generate(msa, ids, 20)
    assert torch.equal(got, want)
    assert max_err(got_logits, want_logits) <= 1e-4
    msa.config.msa["top_k"] = 512
    assert max_err(generate(msa, ids, 20)[1], got_logits) > 1e-3


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_generate_where_msa_is_dense_gives_the_original_tokens(mode):
    """top_k covering every block of the 320 tokens, and warmup: the original model's greedy
    tokens. Layer 0 left dense runs SDPA against the cache."""
    model = make_model("mistral")
    ids = tokens()[:, :300]
    want, want_logits = generate(model, ids, 20)
    msa = converted(model, top_k=384 if mode == "sparse" else 128, layers=[1],
                    warmup=mode == "warmup")
    got, got_logits = generate(msa, ids, 20)
    assert torch.equal(got, want)
    assert max_err(got_logits, want_logits) <= 1e-4


def test_decoding_past_a_sliding_window_is_rejected():
    """transformers' cache keeps only the last sliding_window keys of a Mistral model, while a
    converted layer attends over the whole context: the step after the window raises."""
    config = family_config("mistral")
    config.sliding_window = 256
    torch.manual_seed(70)
    msa = converted(transformers.MistralForCausalLM(config).eval(), top_k=128)
    ids = tokens()[:, :250]
    assert generate(msa, ids, 7)[0].shape[1] == 257  # the last step's keys fill the window
    with pytest.raises(ValueError, match="flash_msa: cache: expected the proxy keys of the 255 "
                                         "cached tokens .*got 256"):
        generate(msa, ids, 8)


def test_a_chunk_of_tokens_against_the_cache():
    """Several new tokens at once after a cached prefix (a prompt continued in chunks): the
    logits of one forward over the whole sequence: the chunk's queries select among the blocks
    of the cached keys (top_k = 256 of 300 tokens). Layer 0, left dense, needs its causal mask
    aligned with the last keys."""
    msa = converted(make_model("qwen2"), top_k=256, layers=[1])
    ids = tokens()
    with torch.no_grad():
        cache = msa(ids[:, :250], use_cache=True).past_key_values
        chunk = msa(ids[:, 250:], cache=cache, use_cache=True).logits
    assert max_err(chunk, logits(msa, ids)[:, 250:]) <= 1e-4


@pytest.mark.skipif(not (torch.cuda.is_available() and flash_msa.built_with_cuda()),
                    reason="needs a CUDA device and flash_msa built with CUDA")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_cuda_logits_equal_the_original_where_msa_is_dense(family, mode):
    """bfloat16 on the GPU against the float64 original on the CPU: twice the error of the
    bfloat16 original (eager, on the GPU)."""
    model = make_model(family)
    ids = tokens()
    ref64 = logits(float64(model), ids)
    model = model.to("cuda", torch.bfloat16)
    baseline = logits(model, ids.cuda())
    warmup = mode == "warmup"
    msa = converted(model, top_k=DENSE_TOP_K if not warmup else 128, warmup=warmup)
    check_rule(f"{family} {mode} logits", logits(msa, ids.cuda()), ref64, baseline, atol=1e-3)
