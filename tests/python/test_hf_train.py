"""Training a model converted by flash_msa.hf: the KL in the loss (kl_weight) and its logged
value, the warmup switch in a plain loop and in transformers.Trainer, packed documents,
activation checkpointing and torch.compile. Tiny random Llama models on the CPU."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.25.0")  # flash_msa.hf's

import flash_msa  # noqa: E402
from conftest import check_rule  # noqa: E402

hf = flash_msa.hf

VOCAB = 97


def llama(seed: int = 80, head_dim: int = 16):
    """A two-layer Llama, hidden 64, GQA 4:2, in float32."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=1024, initializer_range=0.2)
    return transformers.LlamaForCausalLM(config)


def make_model(seed: int = 80, dtype=torch.float32, **convert):
    """llama() converted with proxy_heads=2, in training mode."""
    convert.setdefault("top_k", 128)
    return hf.convert(llama(seed).to(dtype), proxy_heads=2, **convert).train()


def tokens(*shape, seed: int = 81):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def is_proxy(name: str) -> bool:
    return "proxy" in name


def test_the_loss_with_labels_includes_kl_weight_times_the_kl():
    """float64: with labels, loss has the value of the language-model loss and gives the
    proxy projections kl_weight times the KL's gradient, the other weights the same as
    without the KL; kl_value is NaN before the backward and the mean of the layers' values
    after it; with num_items_in_batch (the Trainer's gradient accumulation) the KL counts
    for its share of the tokens; the model deep-copies after a step."""
    base = make_model(dtype=torch.float64, kl_weight=0.0)
    weighted = copy.deepcopy(base)
    weighted.config.msa["kl_weight"] = 0.25
    ids = tokens(2, 300)

    out = base(ids, labels=ids, use_cache=False)
    (out.loss + hf.kl_loss(base)).backward()  # the KL at weight 1, by hand
    want = grads(base)
    assert sum(is_proxy(n) for n in want) == 4  # q and k of both layers

    assert torch.isnan(hf.kl_value(weighted))
    loss = weighted(ids, labels=ids, use_cache=False).loss
    assert loss.item() == out.loss.item()
    loss.backward()
    got = grads(weighted)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        expected = want[name] * 0.25 if is_proxy(name) else want[name]
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15, msg=name)
    values = [layer.self_attn.msa_kl_value for layer in weighted.model.layers]
    assert all(v.dtype == torch.float64 and v > 0 for v in values)
    assert hf.kl_value(weighted).item() == pytest.approx(sum(values).item() / 2, rel=1e-12)
    # The Trainer's gradient accumulation over micro-batches of 4 * 299 counted tokens in all
    # (num_items_in_batch; the language-model loss is then a sum over this micro-batch's
    # 2 * 299 divided by it): the KL gets half its weight.
    weighted.zero_grad()
    weighted(ids, labels=ids, use_cache=False, num_items_in_batch=torch.tensor(4 * 299)
             ).loss.backward()
    for name, grad in grads(weighted).items():
        if is_proxy(name):
            torch.testing.assert_close(grad, want[name] * 0.125, rtol=1e-12, atol=1e-15,
                                       msg=name)
    # A deep copy after a training step (the KL terms are inside the autograd graph) starts
    # without them.
    with pytest.raises(ValueError, match="hf.kl_loss: model: expected a forward"):
        hf.kl_loss(copy.deepcopy(weighted))
    # Without labels there is no loss to add to.
    assert weighted(ids, use_cache=False).loss is None


def test_the_kl_value_keeps_the_statistics_dtype_when_the_model_is_cast():
    """model.to(bfloat16) casts the layers' KL value buffers too; the value is still written
    in float32 (the ops' statistics dtype), and in float64 after model.double()."""
    model = make_model().to(torch.bfloat16)
    ids = tokens(2, 300)
    for dtype in (torch.float32, torch.float64):
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        value = hf.kl_value(model)
        assert value.dtype == dtype and torch.isfinite(value) and value > 0
        model.double()


def test_a_plain_loop_switches_from_warmup_to_sparse():
    """set_warmup by step count: the first steps run the dense warmup (logits independent of
    top_k), the later ones sparse attention; each step trains the proxy and logs a KL value."""
    model = make_model()
    ids = tokens(2, 300)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    proxy = model.model.layers[0].self_attn.q_proxy_proj.weight
    for step in range(4):
        hf.set_warmup(model, step < 2)
        before = proxy.detach().clone()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(hf.kl_value(model)) and hf.kl_value(model) > 0
        assert not torch.equal(proxy, before)
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
            model.config.msa["top_k"] = 384  # every block: sparse is then dense too
            dense = model(ids, use_cache=False).logits
            model.config.msa["top_k"] = 128
        assert torch.equal(logits, dense) == (step < 2)


def test_warmup_callback_in_the_trainer(tmp_path):
    """transformers.Trainer with WarmupCallback(warmup_steps=2) and the flattening collator:
    steps 0 and 1 run the warmup, 2 and 3 sparse; the proxy (trained by the KL alone) and the
    model's own weights change, and every training log carries msa_kl."""
    pytest.importorskip("accelerate")
    model = make_model()
    phases = []
    model.register_forward_pre_hook(lambda m, args: phases.append(m.config.msa["warmup"]))
    data = [{"input_ids": tokens(length, seed=i).tolist()}
            for i, length in enumerate((150, 200, 130, 170, 260, 140, 190, 160))]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=1e-3)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data,
        data_collator=transformers.DataCollatorWithFlattening(),
        callbacks=[hf.WarmupCallback(warmup_steps=2)])
    trainer.train()
    assert phases == [True, True, False, False]
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 4
    assert all(log["msa_kl"] > 0 for log in logs)


def test_warmup_callback_argument():
    with pytest.raises(ValueError, match="flash_msa: hf.WarmupCallback: warmup_steps: expected "
                                         "an int >= 0, got -1"):
        hf.WarmupCallback(warmup_steps=-1)


def docs_alone(model, docs, starts=None):
    """Each document's logits alone, its positions from ``starts`` (default 0)."""
    starts = starts or [0] * len(docs)
    with torch.no_grad():
        return [model(doc[None], position_ids=torch.arange(start, start + len(doc))[None],
                      use_cache=False).logits[0] for doc, start in zip(docs, starts)]


@pytest.mark.parametrize("layers", [None, [1]])
def test_packed_documents_give_each_document_its_own_logits(layers):
    """float64, top_k covering every block: a row of packed documents gives each document the
    logits it has alone, from the flattening collator's position_ids (restarting at 0), or from
    its cu_seq_lens_q alone (the positions then run on across documents, as they would for
    the second one alone at positions 200..369); the same tokens without their documents do
    not. With layers=[1], layer 0 runs SDPA with a document mask."""
    model = make_model(dtype=torch.float64, top_k=384, layers=layers).eval()
    docs = [tokens(200, seed=82), tokens(170, seed=83)]  # the second starts inside block 1
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist()} for d in docs])
    ids = batch["input_ids"]
    cu = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                "max_length_k")}
    with torch.no_grad():
        for kw, starts in ((dict(position_ids=batch["position_ids"]), [0, 0]), (cu, [0, 200])):
            alone = docs_alone(model, docs, starts)
            packed = model(ids, use_cache=False, **kw).logits[0]
            torch.testing.assert_close(packed[:200], alone[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(packed[200:], alone[1], rtol=0, atol=1e-10)
        unpacked = model(ids, use_cache=False).logits[0]
    assert (unpacked[200:] - alone[1]).abs().max() > 1e-2


def test_packed_rows_of_a_batch():
    """Batch of two rows with position_ids restarting inside row 0: its documents and row 1
    each get their own logits (every row boundary is a document boundary)."""
    model = make_model(top_k=384).eval()
    docs = [tokens(140, seed=84), tokens(160, seed=85), tokens(300, seed=86)]
    alone = docs_alone(model, docs)
    ids = torch.stack([torch.cat(docs[:2]), docs[2]])
    position_ids = torch.stack([torch.cat([torch.arange(140), torch.arange(160)]),
                                torch.arange(300)])
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits
    for got, want in ((packed[0, :140], alone[0]), (packed[0, 140:], alone[1]),
                      (packed[1], alone[2])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="flash_msa: cu_seq_lens_q: expected a batch of one "
                                         "packed row"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 300, 600], dtype=torch.int32),
              use_cache=False)


def test_activation_checkpointing_gives_the_same_gradients():
    """activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers
    5.x; the default use_reentrant=False): the same
    loss, gradients (proxy included) and KL value as without; reentrant checkpointing, which
    would drop the KL's gradient, is refused."""
    model = make_model(kl_weight=0.5)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable()
    ids = tokens(2, 300)
    losses = []
    for m in (model, checkpointed):
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    want = grads(model)
    got = grads(checkpointed)
    assert got.keys() == want.keys() and any(is_proxy(n) for n in got)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert hf.kl_value(checkpointed).item() == pytest.approx(hf.kl_value(model).item(),
                                                             rel=1e-6)

    reentrant = make_model()
    reentrant.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="flash_msa: hf.kl_loss: model: expected KL terms with a "
                                         "gradient.*use_reentrant=False"):
        reentrant(ids, labels=ids, use_cache=False)


def test_compiled_model_matches_eager():
    """torch.compile(model, fullgraph=True), a batch whose first row packs two documents:
    loss, gradients and KL value as eager in both phases, and each phase compiles once (the
    aot_eager backend: Dynamo and AOTAutograd trace what Inductor would get, in a fraction of
    the time)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = make_model(kl_weight=0.5)
    ids = tokens(2, 300)
    position_ids = torch.stack([torch.cat([torch.arange(140), torch.arange(160)]),
                                torch.arange(300)])
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for warmup in (False, True, False):
        hf.set_warmup(model, warmup)
        results = []
        for m in (model, compiled):
            model.zero_grad()
            loss = m(ids, position_ids=position_ids, labels=ids, use_cache=False).loss
            loss.backward()
            results.append((loss.detach(), grads(model), hf.kl_value(model).clone()))
        (want_loss, want, want_kl), (loss, got, kl) = results
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-6)
        assert got.keys() == want.keys() and any(is_proxy(n) for n in got)
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5, msg=name)
    # The model's forward in each phase, and the loss hook (a frame of its own).
    assert counter.frame_count == 3


@pytest.mark.skipif(not (torch.cuda.is_available() and flash_msa.built_with_cuda()),
                    reason="needs a CUDA device and flash_msa built with CUDA")
def test_cuda_packed_training_step():
    """bfloat16 on the GPU (head_dim 64, which the kernels take), a packed row from the
    flattening collator, top_k covering every block: each document's logits within the spec's
    rule of its float64 logits alone on the CPU (twice the error of the bfloat16 original
    alone); the backward writes a finite positive KL value and gives the proxy finite nonzero
    gradients."""
    original = llama(head_dim=64)
    docs = [tokens(200, seed=82), tokens(170, seed=83)]
    ref64 = copy.deepcopy(original).double()
    ref64.set_attn_implementation("sdpa")
    bf16 = copy.deepcopy(original).to("cuda", torch.bfloat16)
    bf16.set_attn_implementation("eager")
    with torch.no_grad():
        want = [ref64(d[None], use_cache=False).logits[0] for d in docs]
        baseline = [bf16(d[None].cuda(), use_cache=False).logits[0] for d in docs]
    msa = hf.convert(copy.deepcopy(original).to("cuda", torch.bfloat16), top_k=384,
                     proxy_heads=2).train()
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    out = msa(batch["input_ids"].cuda(), position_ids=batch["position_ids"].cuda(),
              labels=batch["labels"].cuda(), use_cache=False)
    for i, part in enumerate((out.logits[0, :200], out.logits[0, 200:])):
        check_rule(f"document {i} logits", part, want[i], baseline[i].cpu(), atol=1e-3)
    out.loss.backward()
    kl = hf.kl_value(msa)
    assert torch.isfinite(kl) and kl > 0
    for name, p in msa.named_parameters():
        if is_proxy(name):
            assert torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
