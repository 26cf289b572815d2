"""Hugging Face transformers causal LMs with MSA attention: :func:`convert`, and the training
helpers :func:`kl_loss`, :func:`kl_value`, :func:`set_warmup` and :class:`WarmupCallback`.

A converted model keeps its modules, weights and forward; what changes:

- each converted attention module gains the proxy projections ``q_proxy_proj`` and
  ``k_proxy_proj`` (``nn.Linear`` from the hidden states, as in :class:`flash_msa.MSAAttention`);
- the model's attention implementation becomes ``"msa"``, an attention function registered with
  ``transformers.AttentionInterface`` that runs :func:`flash_msa.flash_msa_func` (sparse) or
  :func:`flash_msa.flash_msa_warmup_func` (warmup) on the query, key and value the model
  computed (its own head_dim, RoPE and rope scaling, Qwen3's q/k norms, Qwen2's biases), with
  packed documents taken from ``position_ids`` or ``cu_seq_lens_q``;
- when the model is called with labels, its ``loss`` includes ``kl_weight`` times the KL terms
  of the converted layers;
- the settings are recorded in ``model.config.msa`` (a dict of :func:`convert`'s keyword
  arguments, ``convert(model, **model.config.msa)`` rebuilds the structure).

``model.save_pretrained(path)`` saves the proxy weights with the others and ``config.msa`` in
config.json; :func:`from_pretrained` loads such a directory back as an MSA model.
``model.generate`` decodes with transformers' KV cache: the new tokens run the same ops with
``query_offset`` (no decode kernel), against the proxy keys each layer kept of the cached ones.

Why a forward pre-hook: the attention function receives the module, the query, key and value
and the keyword arguments of the module's forward, but not the hidden states the proxy
projections read, nor the rotary cos/sin. A pre-hook on each converted attention module adds
those two inputs of its forward to its keyword arguments, which the module hands on to the
attention function, so the model's own forward runs unchanged (no module is replaced or
wrapped, the state dict only gains the proxy weights) and nothing is kept on the module between
calls (activation checkpointing replays the forward, torch.compile traces it).

Docs: docs/integrations.md.
"""

import math
import numbers
from typing import Iterable, Optional

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

# The oldest transformers the integration is tested with (scripts/install_deps.sh pins it). With
# 5.17, for one, a chunk of tokens after a cached prefix gets other logits than the whole
# sequence, and models lack activation_checkpointing_enable.
MIN_TRANSFORMERS = "5.25.0"


def _check_transformers(version: str) -> None:
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"flash_msa.hf: expected transformers >= {MIN_TRANSFORMERS}, got "
                          f"{version}")


_check_transformers(transformers.__version__)

from transformers import (MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, AutoConfig,
                          PreTrainedModel, TrainerCallback)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from .interface import _check_top_k, _integer, flash_msa_func, flash_msa_warmup_func

# transformers treats every implementation whose name contains "flash" as FlashAttention (its
# packing and dtype paths), hence a name without it.
ATTN_IMPLEMENTATION = "msa"

# model_type -> (attention module class, the family's rotary function, applied to the proxy too)
_FAMILIES = {
    "llama": (modeling_llama.LlamaAttention, modeling_llama.apply_rotary_pos_emb),
    "mistral": (modeling_mistral.MistralAttention, modeling_mistral.apply_rotary_pos_emb),
    "qwen2": (modeling_qwen2.Qwen2Attention, modeling_qwen2.apply_rotary_pos_emb),
    "qwen3": (modeling_qwen3.Qwen3Attention, modeling_qwen3.apply_rotary_pos_emb),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


def _fail(message: str):
    raise ValueError(f"flash_msa: {message}")


def _pass_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    rotary = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    return args, {**kwargs, "msa_hidden_states": hidden, "msa_position_embeddings": rotary}


def _heads(x: Tensor, heads: int) -> Tensor:
    # (B, S, heads*d) -> (B, heads, S, d) as a strided view: the ops take the strides.
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _document_starts(query: Tensor, position_ids: Optional[Tensor],
                     cu_seq_lens_q: Optional[Tensor]) -> Optional[Tensor]:
    """For a (B, H, S, D) query, int32 (B*S,): the flattened index of the first token of each
    token's document; the documents are those of transformers' ``cu_seq_lens_q`` (offsets over
    the flattening collator's single row), else those that ``position_ids`` marks, else None
    (one document per row). Built without reading the data on the host."""
    batch, seqlen = query.shape[0], query.shape[2]
    token = torch.arange(batch * seqlen, device=query.device, dtype=torch.int32)
    if cu_seq_lens_q is not None:
        if batch != 1:
            _fail(f"cu_seq_lens_q: expected a batch of one packed row (as the flattening "
                  f"collator makes), got a batch of {batch}")
        offsets = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        return offsets[torch.searchsorted(offsets, token, right=True) - 1]
    if position_ids is None:
        return None
    positions = position_ids.to(query.device).expand(batch, seqlen)
    # A document starts where the position does not follow its predecessor (transformers'
    # own rule for packed position_ids) and at every row start.
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    starts = step != 1
    starts[:, 0] = True
    return torch.where(starts.flatten(), token, 0).cummax(0).values


def _cu_seqlens(starts: Tensor) -> Tensor:
    # The start of every token's document, then B*S: non-decreasing and holding every document
    # start, a valid offsets list (the documents in between empty) of a size known without a
    # host sync, which also keeps torch.compile's shapes static.
    return torch.cat([starts, starts.new_full((1,), starts.numel())])


def _document_mask(query: Tensor, starts: Tensor) -> Optional[Tensor]:
    """For SDPA: the (B, 1, S, S) boolean mask of causal attention inside documents, or None
    where every row is one document."""
    rows = starts.view(query.shape[0], -1)
    # A host sync, as in transformers' own detection of packed sequences for SDPA, which only
    # the layers left dense pay; it spares them an S x S mask when nothing is packed. A
    # compiled graph cannot branch on the data and takes the mask.
    if not torch.compiler.is_compiling() and bool((rows == rows[:, :1]).all()):
        return None
    causal = torch.ones(rows.shape[-1], rows.shape[-1], dtype=torch.bool,
                        device=query.device).tril()
    return ((rows.unsqueeze(-1) == rows.unsqueeze(-2)) & causal).unsqueeze(1)


class _LastKL:
    """A layer's KL term of its last forward. A deep copy of the model starts without one,
    as a tensor inside an autograd graph cannot be deep-copied."""

    __slots__ = ("term",)

    def __init__(self):
        self.term = None

    def __deepcopy__(self, memo):
        return _LastKL()


def _kl_buffer(module: nn.Module, query: Tensor) -> Tensor:
    stats = torch.float64 if query.dtype == torch.float64 else torch.float32
    buffer = module.msa_kl_value
    if buffer.dtype != stats or buffer.device != query.device:
        # model.to(dtype) casts buffers too: the KL value keeps the ops' statistics dtype.
        module.msa_kl_value = buffer = torch.full((), math.nan, dtype=stats, device=query.device)
    return buffer


def _proxy_projections(module: nn.Module, kwargs: dict, dtype: torch.dtype
                       ) -> tuple[Tensor, Tensor]:
    """The proxy q (B, Hp, S, D) and k (B, Hpk, S, D) of the tokens of the module's forward,
    with the model's RoPE at their positions (the inputs the pre-hook passes on), in
    ``dtype``."""
    hidden, (cos, sin) = kwargs["msa_hidden_states"], kwargs["msa_position_embeddings"]
    msa = module.config.msa
    # The proxy reads hidden.detach(): the KL trains the proxy projections and nothing else.
    detached = hidden.detach()
    q_proxy = _heads(module.q_proxy_proj(detached), msa["proxy_heads"])
    k_proxy = _heads(module.k_proxy_proj(detached), msa["proxy_kv_heads"])
    q_proxy, k_proxy = module._msa_rotary(q_proxy, k_proxy, cos, sin)
    return q_proxy.to(dtype), k_proxy.to(dtype)


def _cached_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              scaling: Optional[float], dropout: float, **kwargs):
    """Attention of new tokens against transformers' KV cache (``generate``): the queries are at
    positions past .. past+Sq-1 of the key sequence, past = key length - query length.

    A converted module runs the library's ops with ``query_offset=past``, its proxy keys being
    those kept by the forwards since the prefill plus the new ones: each query selects among
    all the cached blocks exactly as in a forward over the whole sequence.
    """
    past = key.shape[2] - query.shape[2]
    if not hasattr(module, "q_proxy_proj"):
        # SDPA's is_causal aligns the queries with the first keys; these are the last ones.
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool,
                            device=query.device).tril(past)
        return sdpa_attention_forward(module, query, key, value, causal[None, None],
                                      dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        _fail(f"dropout: expected 0.0 (the MSA ops have no attention dropout), got {dropout}")
    cached = module._msa_proxy_keys
    batch = query.shape[0]
    if cached is None or cached.shape[0] != batch or cached.shape[2] != past:
        got = "none" if cached is None else f"{cached.shape[2]} of a batch of {cached.shape[0]}"
        _fail(f"cache: expected the proxy keys of the {past} cached tokens of a batch of {batch} "
              f"(kept by this model's forwards that filled the cache from its first token, "
              f"with use_cache=True), got {got}")
    q_proxy, k_proxy = _proxy_projections(module, kwargs, value.dtype)
    k_proxy = torch.cat([cached, k_proxy.detach()], dim=2)
    module._msa_proxy_keys = k_proxy
    msa = module.config.msa
    attend = flash_msa_warmup_func if msa["warmup"] else flash_msa_func
    out = attend(q_proxy, k_proxy, query, key, value, msa["top_k"], scale=scaling,
                 proxy_scale=q_proxy.shape[-1] ** -0.5, query_offset=past, return_kl=False)
    # Decoding trains nothing: no KL term, and kl_loss must not return the prefill's.
    module._msa_kl.term = None
    return out.unflatten(-1, (query.shape[1], -1)), None


def msa_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, position_ids: Optional[Tensor] = None,
                          cu_seq_lens_q: Optional[Tensor] = None, **kwargs):
    """The ``"msa"`` attention function: query (B, H, S, D), key and value (B, Hk, S, D) with
    RoPE applied -> (out (B, S, H, D), None).

    A converted module attends with the library's ops over the whole causal context of each
    document (a sliding window of the model is not applied), the documents being those of
    ``cu_seq_lens_q`` or else of ``position_ids``, and keeps the KL loss term for
    :func:`kl_loss`; the backward writes the KL value into the buffer
    ``module.msa_kl_value``. A module that :func:`convert` left dense runs transformers' SDPA
    attention, causal inside the same documents.
    Keys longer than the queries come from transformers' KV cache (``generate``): see
    ``_cached_attention_forward``; a forward with ``use_cache`` keeps its proxy keys for it.
    """
    # Checked in every layer, so that a layer left dense fails the same way as the first
    # converted one would.
    if attention_mask is not None:
        _fail("attention_mask: expected no padding (MSA attends causally over whole sequences), "
              f"got a mask of shape {tuple(attention_mask.shape)}")
    # Under autocast the model's RoPE multiplies q and k (the proxy's too), projected in the
    # autocast dtype, by fp32 cos/sin: they come in fp32 beside v in the autocast dtype. The
    # ops take one dtype, v's (without autocast all four have it already).
    query, key = query.to(value.dtype), key.to(value.dtype)
    if key.shape[2] != query.shape[2]:
        return _cached_attention_forward(module, query, key, value, scaling, dropout, **kwargs)
    starts = _document_starts(query, position_ids, cu_seq_lens_q)
    if not hasattr(module, "q_proxy_proj"):
        mask = None if starts is None else _document_mask(query, starts)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        _fail(f"dropout: expected 0.0 (the MSA ops have no attention dropout), got {dropout}")
    msa = module.config.msa
    q_proxy, k_proxy = _proxy_projections(module, kwargs, value.dtype)
    # Decoding steps with the cache this forward fills read these; None frees the last ones.
    module._msa_proxy_keys = k_proxy.detach() if kwargs.get("use_cache") else None
    attend = flash_msa_warmup_func if msa["warmup"] else flash_msa_func
    out, kl = attend(q_proxy, k_proxy, query, key, value, msa["top_k"], scale=scaling,
                     proxy_scale=q_proxy.shape[-1] ** -0.5,
                     cu_seqlens=None if starts is None else _cu_seqlens(starts),
                     kl_out=_kl_buffer(module, query))
    module._msa_kl.term = kl
    return out.unflatten(-1, (query.shape[1], -1)), None


AttentionInterface.register(ATTN_IMPLEMENTATION, msa_attention_forward)
# A mask only where there is padding (which the attention function rejects); the causal
# structure is the ops' own.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


def _count(name: str, value, default: int) -> int:
    if value is None:
        return default
    count = _integer(value)
    if count is None or count < 1:
        _fail(f"hf.convert: {name}: expected an int >= 1, got {value!r}")
    return count


def _layer_list(layers, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    try:
        chosen = [_integer(i) for i in layers]
    except TypeError:
        chosen = [None]
    if not chosen or any(i is None or not 0 <= i < num_layers for i in chosen) \
            or len(set(chosen)) != len(chosen):
        _fail(f"hf.convert: layers: expected None or distinct layer indices in [0, {num_layers}), "
              f"got {layers!r}")
    return sorted(chosen)


def _family(model):
    if not isinstance(model, PreTrainedModel):
        _fail(f"hf.convert: model: expected a transformers PreTrainedModel, got "
              f"{type(model).__name__}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _FAMILIES:
        _fail(f"hf.convert: model: expected a model of the {', '.join(SUPPORTED_MODEL_TYPES)} "
              f"families (config.model_type), got {type(model).__name__} with model_type "
              f"{model_type!r}")
    return _FAMILIES[model_type]


def convert(model: PreTrainedModel, *, top_k: int, proxy_heads: Optional[int] = None,
            proxy_kv_heads: int = 1, layers: Optional[Iterable[int]] = None,
            warmup: bool = False, kl_weight: float = 1.0) -> PreTrainedModel:
    """Turns a transformers model of the Llama, Mistral, Qwen2 or Qwen3 family into an MSA model,
    in place, and returns it.

    ``top_k`` counts tokens (a positive multiple of 128, as in :func:`flash_msa.flash_msa_func`).
    ``proxy_heads`` (default: the model's key/value heads) proxy query heads share
    ``proxy_kv_heads`` proxy key heads; proxy head p selects for the model's query heads
    p*G .. p*G+G-1 (G = heads / proxy_heads). The proxy head_dim is the model's head_dim, so the
    proxy q/k get the model's own RoPE (its cos/sin, rope scaling included). The proxy
    projections have a bias where the model's q_proj has one and are initialised as the model
    initialises its linear layers (normal, std ``config.initializer_range``; bias 0); Qwen3's
    q/k norms stay on the main branch only. ``layers`` names the layer indices to convert (all
    by default); the others run transformers' SDPA attention. ``warmup=True`` runs the dense
    warmup phase (:func:`set_warmup` switches it later).

    ``kl_weight`` (the paper's lambda, a number >= 0): a call with labels returns as ``loss``
    the language-model loss plus ``kl_weight`` times the KL terms of the converted layers
    (:func:`kl_loss`). The terms are 0 in value (the loss reads the same) and give the proxy
    projections, and nothing else, the KL's gradient times ``kl_weight``; 0 leaves the terms
    to the caller.

    With ``top_k`` covering every 128-token block of the sequence, and in warmup mode, the
    logits and the gradients of the model's own weights are those of the original model up to
    rounding; the KL terms (:func:`kl_loss`) train only the proxy projections. Decoding with
    transformers' KV cache (``generate``, greedy or sampling; not beam search: it reorders the
    cache's rows, not the proxy keys) gives the tokens of forwards over whole sequences. Not
    supported: padding masks and attention dropout (ValueError); a sliding window is not
    applied to converted layers.
    """
    attention_class, rotary = _family(model)
    config = model.config
    modules = [m for m in model.modules() if type(m) is attention_class]
    if any(hasattr(m, "q_proxy_proj") for m in modules):
        _fail("hf.convert: model: expected a model that is not converted yet, got one whose "
              "attention already has proxy projections")
    top_k = _check_top_k(top_k, "hf.convert: ")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    proxy_heads = _count("proxy_heads", proxy_heads, kv_heads)
    proxy_kv_heads = _count("proxy_kv_heads", proxy_kv_heads, 1)
    if heads % proxy_heads:
        _fail(f"hf.convert: proxy_heads: expected a divisor of the model's {heads} attention "
              f"heads, got {proxy_heads}")
    if proxy_heads % proxy_kv_heads:
        _fail(f"hf.convert: proxy_kv_heads: expected a divisor of proxy_heads ({proxy_heads}), "
              f"got {proxy_kv_heads}")
    if not isinstance(warmup, bool):
        _fail(f"hf.convert: warmup: expected a bool, got {warmup!r}")
    if isinstance(kl_weight, bool) or not isinstance(kl_weight, numbers.Real) \
            or not math.isfinite(kl_weight) or kl_weight < 0:
        _fail(f"hf.convert: kl_weight: expected a finite number >= 0, got {kl_weight!r}")
    if getattr(config, "attention_dropout", 0.0):
        _fail(f"hf.convert: model: expected attention_dropout 0.0 (the MSA ops have no attention "
              f"dropout), got {config.attention_dropout}")
    chosen = _layer_list(layers, config.num_hidden_layers)
    std = config.initializer_range
    for module in modules:
        if module.layer_idx not in chosen:
            continue
        weight = module.q_proj.weight
        factory = dict(bias=module.q_proj.bias is not None, device=weight.device,
                       dtype=weight.dtype)
        hidden_size, head_dim = weight.shape[1], module.head_dim
        module.q_proxy_proj = nn.Linear(hidden_size, proxy_heads * head_dim, **factory)
        module.k_proxy_proj = nn.Linear(hidden_size, proxy_kv_heads * head_dim, **factory)
        for proj in (module.q_proxy_proj, module.k_proxy_proj):
            nn.init.normal_(proj.weight, std=std)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        module._msa_rotary = rotary
        module._msa_kl = _LastKL()
        module._msa_proxy_keys = None
        # One tensor for the layer's whole life, not one per forward: activation checkpointing
        # replays the forward, and the backward writes into the tensor of the first pass.
        stats = torch.float64 if weight.dtype == torch.float64 else torch.float32
        module.register_buffer("msa_kl_value", torch.full((), math.nan, dtype=stats,
                                                          device=weight.device), persistent=False)
        module.register_forward_pre_hook(_pass_inputs, with_kwargs=True)
    config.msa = dict(top_k=top_k, proxy_heads=proxy_heads, proxy_kv_heads=proxy_kv_heads,
                      layers=chosen, warmup=warmup, kl_weight=float(kl_weight))
    model.register_forward_hook(_add_kl_to_loss, with_kwargs=True)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _converted(model, where: str) -> list[nn.Module]:
    modules = [m for m in model.modules() if hasattr(m, "q_proxy_proj")]
    if not modules or getattr(getattr(model, "config", None), "msa", None) is None:
        _fail(f"hf.{where}: model: expected a model converted by flash_msa.hf.convert, got "
              f"{type(model).__name__}")
    return modules


def set_warmup(model: PreTrainedModel, enabled: bool) -> None:
    """Switches a converted model to the dense warmup phase (``enabled=True``) or to sparse
    attention (False); ``model.config.msa["warmup"]`` records it."""
    _converted(model, "set_warmup")
    if not isinstance(enabled, bool):
        _fail(f"hf.set_warmup: enabled: expected a bool, got {enabled!r}")
    model.config.msa["warmup"] = enabled


def kl_loss(model: PreTrainedModel) -> Tensor:
    """The sum of the KL loss terms of the converted layers' last forward: add it times the
    paper's weight to a loss of your own to train the proxy projections (a call with labels
    adds it times ``kl_weight`` to its ``loss`` already). Its value is 0 (the ops' placeholder,
    docs/python.md); the value to log is :func:`kl_value` once the backward has run."""
    modules = _converted(model, "kl_loss")
    terms = [m._msa_kl.term for m in modules]
    if any(t is None for t in terms):
        _fail("hf.kl_loss: model: expected a forward of the converted model first, got none")
    if model.training and torch.is_grad_enabled() and any(not t.requires_grad for t in terms) \
            and any(p.requires_grad for m in modules for p in m.q_proxy_proj.parameters()):
        # What reentrant activation checkpointing (training mode only) does: the layers'
        # forward runs without autograd, and its replay in the backward only follows the
        # layer outputs.
        _fail("hf.kl_loss: model: expected KL terms with a gradient, got terms computed "
              "without autograd (activation checkpointing with use_reentrant=True?); use "
              "use_reentrant=False, transformers' default")
    return torch.stack(terms).sum()


def _add_kl_to_loss(model: nn.Module, args: tuple, kwargs: dict, output):
    weight = model.config.msa["kl_weight"]
    if not weight or getattr(output, "loss", None) is None:
        return output
    kl = kl_loss(model)
    total = kwargs.get("num_items_in_batch")
    if total is not None:
        # The Trainer's gradient accumulation: the language-model loss of each micro-batch is
        # its sum over tokens divided by the tokens of all micro-batches (num_items_in_batch,
        # counted over the shifted labels), and the Trainer does not divide it again; the KL,
        # a mean, gets this micro-batch's share of the tokens likewise.
        labels = kwargs.get("shift_labels")
        if labels is None:
            if kwargs.get("labels") is None:
                _fail("labels: expected labels (or shift_labels) as a keyword argument with "
                      "num_items_in_batch, got them positionally")
            labels = kwargs["labels"][..., 1:]
        share = (labels != -100).sum().to(kl.device, kl.dtype)
        kl = kl * share / torch.as_tensor(total).to(kl.device, kl.dtype)
    output.loss = output.loss + weight * kl
    return output


def kl_value(model: PreTrainedModel) -> Tensor:
    """The mean over the converted layers of the KL value that the last backward wrote
    (0-dim fp32, float64 for a float64 model; NaN before the first backward). A tensor on the
    model's device, so that reading it is the caller's host sync (``float(kl_value(model))``)."""
    values = [m.msa_kl_value for m in _converted(model, "kl_value")]
    return torch.stack([v.to(values[0].device) for v in values]).mean()


class WarmupCallback(TrainerCallback):
    """A ``transformers.Trainer`` callback: the converted model trains in the dense warmup
    phase for the first ``warmup_steps`` optimizer steps, then sparse (:func:`set_warmup`
    before each step), and every log of the Trainer gains ``msa_kl``, the mean of
    :func:`kl_value` over the steps since the previous log.

    The Trainer hands the log to the callbacks in their order, and those of ``report_to``
    come before the ones passed as ``callbacks=``: for them to see ``msa_kl`` too, put this
    one first, ``trainer.callback_handler.callbacks.insert(0, WarmupCallback(...))``.
    """

    def __init__(self, warmup_steps: int):
        steps = _integer(warmup_steps)
        if steps is None or steps < 0:
            _fail(f"hf.WarmupCallback: warmup_steps: expected an int >= 0, got {warmup_steps!r}")
        self.warmup_steps = steps
        self._kl_sum, self._kl_steps = None, 0

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        set_warmup(model, state.global_step < self.warmup_steps)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        value = kl_value(model)
        self._kl_sum = value if self._kl_sum is None else self._kl_sum + value
        self._kl_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._kl_steps or "loss" not in logs:
            return
        kl = float(self._kl_sum) / self._kl_steps
        logs["msa_kl"] = kl
        # The Trainer records its log history before it calls the callbacks.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1]["msa_kl"] = kl
        self._kl_sum, self._kl_steps = None, 0


def from_pretrained(path, **kwargs) -> PreTrainedModel:
    """Loads a model that was converted by :func:`convert` and saved with ``save_pretrained``:
    the causal LM class of its config, converted with the saved ``config.msa`` (warmup flag
    included), with every weight of the checkpoint, the proxy projections' too. ``kwargs`` go
    to transformers' ``from_pretrained`` (``dtype``, ``device_map``, ...).

    ``AutoModelForCausalLM.from_pretrained(path)`` would build the plain model and drop the
    proxy weights as unexpected keys.
    """
    config = AutoConfig.from_pretrained(path)
    msa = getattr(config, "msa", None)
    if not isinstance(msa, dict):
        _fail(f"hf.from_pretrained: path: expected a model saved after flash_msa.hf.convert (a "
              f"config with 'msa'), got {str(path)!r} whose config has none")
    if config.model_type not in _FAMILIES:
        _fail(f"hf.from_pretrained: path: expected a model of the "
              f"{', '.join(SUPPORTED_MODEL_TYPES)} families (config.model_type), got "
              f"model_type {config.model_type!r}")
    base = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

    # Converting in the constructor gives the model its proxy projections before transformers
    # loads the checkpoint, so that its own loader fills them with every other weight (dtype,
    # device_map, shards and tied weights handled as for any model).
    class Converting(base):
        def __init__(self, config, *args, **init_kwargs):
            super().__init__(config, *args, **init_kwargs)
            convert(self, **config.msa)

    loaded = Converting.from_pretrained(path, config=config, **kwargs)
    # The subclass only served the construction: the result is the model convert() makes.
    # (With output_loading_info=True transformers returns (model, loading_info).)
    (loaded[0] if isinstance(loaded, tuple) else loaded).__class__ = base
    return loaded
