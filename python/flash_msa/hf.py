"""Hugging Face transformers causal LMs with MSA attention: :func:`convert`.

A converted model keeps its modules, weights and forward; what changes:

- each converted attention module gains the proxy projections ``q_proxy_proj`` and
  ``k_proxy_proj`` (``nn.Linear`` from the hidden states, as in :class:`flash_msa.MSAAttention`);
- the model's attention implementation becomes ``"msa"``, an attention function registered with
  ``transformers.AttentionInterface`` that runs :func:`flash_msa.flash_msa_func` (sparse) or
  :func:`flash_msa.flash_msa_warmup_func` (warmup) on the query, key and value the model
  computed (its own head_dim, RoPE and rope scaling, Qwen3's q/k norms, Qwen2's biases);
- the settings are recorded in ``model.config.msa`` (a dict of :func:`convert`'s keyword
  arguments, ``convert(model, **model.config.msa)`` rebuilds the structure).

``model.save_pretrained(path)`` saves the proxy weights with the others and ``config.msa`` in
config.json; :func:`from_pretrained` loads such a directory back as an MSA model.
``model.generate`` decodes with transformers' KV cache: the new tokens run the same ops with
``query_offset`` (no decode kernel), against the proxy keys each layer kept of the cached ones.

Why a forward pre-hook: the attention function receives the module, the query, key and value
and keyword arguments, but not the hidden states the proxy projections read, nor the rotary
cos/sin. A pre-hook on each converted attention module stashes those two inputs of its forward
for the attention function and a forward hook drops them again, so the model's own forward
runs unchanged (no module is replaced or wrapped, the state dict only gains the proxy weights).

Docs: docs/integrations.md.
"""

import math
from typing import Iterable, Optional

import torch
from torch import Tensor, nn
from transformers import (MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, AutoConfig,
                          PreTrainedModel)
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


def _stash_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    rotary = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    module._msa_inputs = (hidden, rotary)


def _drop_inputs(module: nn.Module, args: tuple, output) -> None:
    # The stash would otherwise keep the last hidden states alive between steps.
    module._msa_inputs = None


def _heads(x: Tensor, heads: int) -> Tensor:
    # (B, S, heads*d) -> (B, heads, S, d) as a strided view: the ops take the strides.
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _proxy_projections(module: nn.Module) -> tuple[Tensor, Tensor]:
    """The proxy q (B, Hp, S, D) and k (B, Hpk, S, D) of the tokens of the module's forward,
    with the model's RoPE at their positions."""
    hidden, (cos, sin) = module._msa_inputs
    msa = module.config.msa
    # The proxy reads hidden.detach(): the KL trains the proxy projections and nothing else.
    detached = hidden.detach()
    q_proxy = _heads(module.q_proxy_proj(detached), msa["proxy_heads"])
    k_proxy = _heads(module.k_proxy_proj(detached), msa["proxy_kv_heads"])
    return module._msa_rotary(q_proxy, k_proxy, cos, sin)


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
    q_proxy, k_proxy = _proxy_projections(module)
    k_proxy = torch.cat([cached, k_proxy.detach()], dim=2)
    module._msa_proxy_keys = k_proxy
    msa = module.config.msa
    attend = flash_msa_warmup_func if msa["warmup"] else flash_msa_func
    out = attend(q_proxy, k_proxy, query, key, value, msa["top_k"], scale=scaling,
                 proxy_scale=q_proxy.shape[-1] ** -0.5, query_offset=past, return_kl=False)
    # Decoding trains nothing: no KL term, and kl_loss must not return the prefill's.
    module.msa_kl = module.msa_kl_value = None
    return out.unflatten(-1, (query.shape[1], -1)), None


def msa_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs):
    """The ``"msa"`` attention function: query (B, H, S, D), key and value (B, Hk, S, D) with
    RoPE applied -> (out (B, S, H, D), None).

    A converted module attends with the library's ops over the whole causal context (a sliding
    window of the model is not applied) and keeps the KL loss term in ``module.msa_kl`` and the
    KL value, written by the backward, in ``module.msa_kl_value``. A module that
    :func:`convert` left dense runs transformers' SDPA attention, causal without a mask.
    Keys longer than the queries come from transformers' KV cache (``generate``): see
    ``_cached_attention_forward``; a forward with ``use_cache`` keeps its proxy keys for it.
    """
    # Checked in every layer, so that a layer left dense fails the same way as the first
    # converted one would.
    if attention_mask is not None:
        _fail("attention_mask: expected no padding (MSA attends causally over whole sequences), "
              f"got a mask of shape {tuple(attention_mask.shape)}")
    if key.shape[2] != query.shape[2]:
        return _cached_attention_forward(module, query, key, value, scaling, dropout, **kwargs)
    if not hasattr(module, "q_proxy_proj"):
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        _fail(f"dropout: expected 0.0 (the MSA ops have no attention dropout), got {dropout}")
    msa = module.config.msa
    q_proxy, k_proxy = _proxy_projections(module)
    # Decoding steps with the cache this forward fills read these; None frees the last ones.
    module._msa_proxy_keys = k_proxy.detach() if kwargs.get("use_cache") else None
    stats = torch.float64 if query.dtype == torch.float64 else torch.float32
    kl_value = torch.full((), math.nan, dtype=stats, device=query.device)
    attend = flash_msa_warmup_func if msa["warmup"] else flash_msa_func
    out, kl = attend(q_proxy, k_proxy, query, key, value, msa["top_k"], scale=scaling,
                     proxy_scale=q_proxy.shape[-1] ** -0.5, kl_out=kl_value)
    module.msa_kl, module.msa_kl_value = kl, kl_value
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
            warmup: bool = False) -> PreTrainedModel:
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
        module._msa_inputs = module._msa_proxy_keys = None
        module.msa_kl = module.msa_kl_value = None
        module.register_forward_pre_hook(_stash_inputs, with_kwargs=True)
        module.register_forward_hook(_drop_inputs)
    config.msa = dict(top_k=top_k, proxy_heads=proxy_heads, proxy_kv_heads=proxy_kv_heads,
                      layers=chosen, warmup=warmup)
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
    """The sum of the KL loss terms of the converted layers' last forward: add it (times the
    paper's weight) to the language-model loss to train the proxy projections. Its value is 0
    (the ops' placeholder, docs/python.md); the value to log is in each layer's
    ``msa_kl_value`` once the backward has run."""
    terms = [m.msa_kl for m in _converted(model, "kl_loss")]
    if any(t is None for t in terms):
        _fail("hf.kl_loss: model: expected a forward of the converted model first, got none")
    return torch.stack(terms).sum()


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
