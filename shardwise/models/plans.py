"""Model plans: one small table per model family, read by every part that splits a model.

A plan says, by module path (``*`` stands for a block's index):

  tp        which modules tensor parallelism splits and how (:class:`Split`): ``colwise``
            (output features split; ``parts`` interleaved groups, e.g. a fused q|k|v), ``rowwise``
            (input features split, outputs summed), ``vocab`` (an embedding split by rows of
            the vocabulary), ``vocab_head`` (the output head, column-parallel over the vocabulary,
            read by the vocab-parallel loss); ``transposed`` for Hugging Face's Conv1D, whose
            weight is (in, out), so colwise / rowwise split its other dimension. Every module not
            named is replicated (norms, position embeddings, rotary tables).
  regions   sequence parallelism (``--sp``): the modules of each block that tensor parallelism
            splits inside (attention, MLP), whose input must be the whole sequence; the rest of a
            block (norms, residual adds, dropout) runs on a slice of it
  norm      sequence parallelism: the final norm, the last module on a slice (the head after it
            reads the whole sequence)
  heads     attributes of attention modules that hold head counts or widths the module reshapes
            by: divided by tp after the split, so each rank runs its own heads
  blocks    the ModuleList of transformer blocks: the units of activation checkpointing, of
            ZeRO-3 (their class) and of the pipeline's cuts
  first / last / shared   the pipeline: modules of the first stage (embeddings), of the last
            (final norm, head), and those every stage keeps (Llama's rotary table, no weights)
  sizes     the model's head counts, vocabulary and width (n_head, n_kv_head, vocab_size, n_embd;
            a model without attention may leave the heads out; vocab_size is needed with a
            ``vocab_head``, whose logits the vocab-parallel loss reads)
  attention / positions   context parallelism (``--cp``): the attention modules, whose
            attention is replaced (an ``attend(q, k, v, scale=)`` method, as shardwise's GPT
            has, or transformers' attention interface), and where the positions enter: a
            module looked up by positions 0..T-1 (``module:pos_emb``, learned positions) or a
            forward argument (``argument:position_ids``, Hugging Face: rotary or learned)
  ids / inputs   the pipeline: the forward's argument that holds the token ids, and the other
            arguments its stages take (Hugging Face: attention_mask, position_ids, labels...);
            a batch may be a tensor (the ids), a tuple (positional) or a dict (keyword), bound to
            the model's forward signature as the whole model would take it. Every stage reads
            them from its own copy of the micro-batch (every pp rank loads the same rows), so
            nothing but the residual stream travels between stages
  embed / context / block / final   one pipeline stage's forward, piece by piece, matching the
            model's own: ``embed(stage, ids, inputs)`` -> residual stream (first stage);
            ``context(stage, h, inputs)`` once per stage (the attention mask, positions,
            rotary table; None when there is none); ``block(stage, block, h, context)`` -> h;
            ``final(stage, h, inputs)`` -> logits, or a ModelOutput with the model's own
            loss when ``inputs`` holds labels (``prepare(..., loss_from="loss")``)

Plans exist for shardwise's GPT, Hugging Face GPT2LMHeadModel and LlamaForCausalLM; a person's
model gets one with :func:`register_plan` (``shardwise.register_plan``). The registry is keyed by
class: a model uses the plan of the first class in its MRO that has one (the built-in ones are
matched by class name, so that transformers is imported only by whoever builds such a model).
This module is data: the parallel code (shardwise/parallel/) reads it; nothing here communicates.
"""
from __future__ import annotations

import fnmatch
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

STYLES = ("colwise", "rowwise", "vocab", "vocab_head")


@dataclass(frozen=True)
class Split:
    """How tensor parallelism splits one module (see the module docstring)."""
    style: str
    parts: int = 1
    transposed: bool = False

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"Split.style {self.style!r}: use one of {STYLES}")
        if self.parts < 1 or (self.parts > 1 and self.style != "colwise"):
            raise ValueError("Split.parts > 1 is for colwise modules (a fused q|k|v: parts=3)")


@dataclass(frozen=True)
class ModelPlan:
    """One model family's table (the module docstring says what each field is for)."""
    blocks: str
    tp: dict = field(default_factory=dict)            # path -> Split
    heads: dict = field(default_factory=dict)         # attention path -> attribute names
    regions: tuple = ()                               # sp: split modules of a block (patterns)
    norm: str = ""                                    # sp: the final norm's path
    first: tuple = ()
    last: tuple = ()
    shared: tuple = ()
    sizes: Callable[[nn.Module], dict] | None = None
    ids: str = "input_ids"                            # the forward's token-id argument
    inputs: tuple = ()                                # the other arguments stages take
    embed: Callable | None = None                     # (stage, ids (B, T), inputs) -> (B, T, C)
    context: Callable | None = None                   # (stage, h, inputs) -> what blocks need
    block: Callable | None = None                     # (stage, block, h (B, T, C), context) -> h
    final: Callable | None = None                     # (stage, h, inputs) -> logits (B, T, V)
    attention: str = ""                               # cp: the attention modules (a pattern)
    positions: str = ""                               # cp: "module:PATH" or "argument:NAME"

    def blocks_of(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.blocks)

    def matches(self, path: str, patterns) -> str | None:
        """The pattern of ``patterns`` that names module ``path`` (None: none does)."""
        return next((p for p in patterns if fnmatch.fnmatchcase(path, p)
                     and path.count(".") == p.count(".")), None)

    def split_of(self, path: str) -> Split | None:
        key = self.matches(path, self.tp)
        return None if key is None else self.tp[key]

    def head_attrs(self, path: str) -> tuple:
        key = self.matches(path, self.heads)
        return () if key is None else tuple(self.heads[key])


_REGISTRY: dict = {}          # class (or built-in class name) -> ModelPlan


def register_plan(cls: type, plan: ModelPlan) -> None:
    """Give models of class ``cls`` (and its subclasses) ``plan``: tensor and pipeline
    parallelism, activation checkpointing and ZeRO-3's units then know how to split them."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_plan: {cls!r} is not an nn.Module class")
    if not isinstance(plan, ModelPlan):
        raise TypeError(f"register_plan: give a shardwise.models.plans.ModelPlan, not "
                        f"{type(plan).__name__}")
    _REGISTRY[cls] = plan


def registered_modules() -> set[str]:
    """The Python modules that define a class with a registered plan (user models)."""
    return {c.__module__ for c in _REGISTRY if isinstance(c, type)}


def _lookup(cls: type) -> ModelPlan | None:
    owner = plan_class(cls)
    if owner is None:
        return None
    return _REGISTRY[owner] if owner in _REGISTRY else _REGISTRY[owner.__name__]


def plan_class(cls: type) -> type | None:
    """The class in ``cls``'s MRO whose plan applies to it (itself, or a base)."""
    for c in cls.__mro__:
        if c in _REGISTRY:
            return c
    for c in cls.__mro__:
        if c.__name__ in _REGISTRY and _builtin(c):
            return c
    return None


def plan_of(model: nn.Module) -> ModelPlan | None:
    """The plan of ``model``'s class (None: no plan; such a model trains under dp / ZeRO).
    A plan whose modules ``model`` does not have (a wrapper registered with the plan of the
    Hugging Face model it holds) is refused in one line (:func:`_check_fits`)."""
    plan = _lookup(type(model))
    if plan is not None:
        _check_fits(model, plan)
    return plan


def _check_fits(model: nn.Module, plan: ModelPlan) -> None:
    """Every module path the plan names exists in ``model``, and its sizes can be read; else
    one TypeError line naming the class, the missing path and the fix (instead of an
    AttributeError from deep inside a pipeline stage or a tensor-parallel split)."""
    name = type(model).__name__
    missing = next((p for p in (plan.blocks, *plan.first, *plan.last, *plan.shared,
                                *((plan.norm,) if plan.norm else ()))
                    if not _has_module(model, p)), None)
    why = f"names module {missing!r}, which {name} does not have" if missing else None
    if why is None and plan.sizes is not None:
        try:
            plan.sizes(model)
        except AttributeError as e:
            why = f"reads its sizes from attributes {name} does not have ({e})"
    if why is None:
        return
    inner = next(((path, type(m).__name__) for path, m in model.named_modules()
                  if path and _lookup(type(m)) is not None), None)
    holds = f" (it holds a {inner[1]} at {inner[0]!r})" if inner else ""
    itself = f"pass the {inner[1]} itself to shardwise.prepare" if inner else \
        "train it with --dp and --zero-stage 0-3"
    raise TypeError(f"the model plan found for {name} {why}{holds}, so tensor / pipeline "
                    f"parallelism cannot split it; fix: shardwise.register_plan({name}, "
                    f"ModelPlan(...)) with module paths (and embed / final pieces) that start "
                    f"at {name}, or {itself}")


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _builtin(cls: type) -> bool:
    return cls.__module__.startswith(("shardwise.models", "transformers."))


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def block_class(model: nn.Module) -> str | None:
    """The largest repeated module class: occurs >= 2 times, most parameters per instance."""
    counts, sizes = Counter(), {}
    for m in model.modules():
        if isinstance(m, CONTAINERS) or m is model:
            continue
        name = type(m).__name__
        counts[name] += 1
        sizes[name] = max(sizes.get(name, 0), sum(p.numel() for p in m.parameters()))
    repeated = [n for n, k in counts.items() if k >= 2 and sizes[n] > 0]
    return max(repeated, key=lambda n: sizes[n]) if repeated else None


def block_class_names(model: nn.Module) -> list[str] | None:
    """The class names of the plan's blocks (ZeRO-3's default units), None without a plan."""
    plan = plan_of(model)
    if plan is None:
        return None
    return sorted({type(b).__name__ for b in plan.blocks_of(model)})


# -- shardwise's GPT (models/gpt.py) -------------------------------------------------------------
def _gpt_embed(stage, ids):
    pos = torch.arange(ids.shape[1], device=ids.device)
    return stage.drop(stage.tok_emb(ids) + stage.pos_emb(pos))            # (B, T, C)


_REGISTRY["GPT"] = ModelPlan(
    blocks="blocks",
    tp={"blocks.*.attn.qkv": Split("colwise", parts=3), "blocks.*.attn.proj": Split("rowwise"),
        "blocks.*.mlp.fc": Split("colwise"), "blocks.*.mlp.proj": Split("rowwise"),
        "tok_emb": Split("vocab"), "head": Split("vocab_head")},
    heads={"blocks.*.attn": ("n_head",)},
    regions=("blocks.*.attn", "blocks.*.mlp"), norm="ln_f",
    first=("tok_emb", "pos_emb", "drop"), last=("ln_f", "head"),
    sizes=lambda m: dict(n_head=m.cfg.n_head, n_kv_head=m.cfg.n_head,
                         vocab_size=m.cfg.vocab_size, n_embd=m.cfg.n_embd),
    attention="blocks.*.attn", positions="module:pos_emb",
    ids="idx", embed=lambda stage, ids, inputs: _gpt_embed(stage, ids),
    block=lambda stage, b, h, ctx: b(h), final=lambda stage, h, inputs: stage.head(stage.ln_f(h)))


# -- Hugging Face models: the pieces of their forward a stage runs ------------------------------
HF_INPUTS = ("attention_mask", "position_ids", "labels")


def _positions(inputs, h):
    """position_ids as the model's forward makes them: given, or 0..T-1 as (1, T)."""
    pos = inputs.get("position_ids")
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0) if pos is None else pos


@functools.lru_cache(maxsize=1)
def _mask_function():
    """transformers' ``create_causal_mask`` and its parameter names (read once)."""
    import inspect
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError:          # transformers older than 4.53
        raise RuntimeError("an attention_mask under pipeline parallelism is built with "
                           "transformers' masking_utils (4.53 or newer); fix: pip install -U "
                           "transformers, or leave attention_mask out of the batch") from None
    return create_causal_mask, set(inspect.signature(create_causal_mask).parameters)


def _hf_mask(stage, h, inputs, pos):
    """The attention mask the model's forward would build from a 2-D attention_mask (padding)
    and causality: transformers' own ``create_causal_mask`` (None for plain causal attention,
    which the attention runs as is_causal). Its keyword names differ between transformers
    releases, so they are read off its signature."""
    mask = inputs.get("attention_mask")
    if mask is None:
        return None
    create_causal_mask, names = _mask_function()
    kw = dict(config=stage.config, attention_mask=mask.view(h.shape[0], -1),
              position_ids=pos)
    kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    for none in ("cache", "past_key_values"):
        if none in names:
            kw[none] = None
    if "cache_position" in names:
        kw["cache_position"] = torch.arange(h.shape[1], device=h.device)
    return create_causal_mask(**kw)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _lm_output(stage, logits, inputs):
    """The last pipeline stage's output of a Hugging Face model: a ModelOutput with its logits,
    as the model's own forward returns (a user's loss reads ``out["logits"]`` or ``out.logits``),
    and with labels in the batch the model's own loss (its ``loss_function``: shifted
    cross-entropy, -100 ignored)."""
    labels = inputs.get("labels")
    loss = None if labels is None else stage.loss_function(logits=logits, labels=labels,
                                                    vocab_size=stage.config.vocab_size)
    try:
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except ImportError:          # a model of this plan was built, so transformers is there
        return {"logits": logits} if loss is None else {"loss": loss, "logits": logits}
    return CausalLMOutputWithPast(loss=loss, logits=logits)


# -- Hugging Face GPT-2: Conv1D weights (in, out), lm_head tied to wte ----------------------------
def _gpt2_embed(stage, ids, inputs):
    t = stage.transformer
    h = t.wte(ids)
    h = h + t.wpe(_positions(inputs, h))
    if inputs.get("token_type_ids") is not None:
        h = h + t.wte(inputs["token_type_ids"])
    return t.drop(h)                                                       # (B, T, C)


def _gpt2_context(stage, h, inputs):
    pos = _positions(inputs, h)
    return dict(mask=_hf_mask(stage, h, inputs, pos), pos=pos)


_REGISTRY["GPT2LMHeadModel"] = ModelPlan(
    blocks="transformer.h",
    tp={"transformer.h.*.attn.c_attn": Split("colwise", parts=3, transposed=True),
        "transformer.h.*.attn.c_proj": Split("rowwise", transposed=True),
        "transformer.h.*.mlp.c_fc": Split("colwise", transposed=True),
        "transformer.h.*.mlp.c_proj": Split("rowwise", transposed=True),
        "transformer.wte": Split("vocab"), "lm_head": Split("vocab_head")},
    heads={"transformer.h.*.attn": ("num_heads", "split_size", "embed_dim")},
    regions=("transformer.h.*.attn", "transformer.h.*.mlp"), norm="transformer.ln_f",
    first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    last=("transformer.ln_f", "lm_head"),
    sizes=lambda m: dict(n_head=m.config.n_head, n_kv_head=m.config.n_head,
                         vocab_size=m.config.vocab_size, n_embd=m.config.n_embd),
    attention="transformer.h.*.attn", positions="argument:position_ids",
    inputs=(*HF_INPUTS, "token_type_ids"), embed=_gpt2_embed, context=_gpt2_context,
    block=lambda stage, b, h, ctx: _first(b(h, attention_mask=ctx["mask"],
                                            position_ids=ctx["pos"])),
    final=lambda stage, h, inputs: _lm_output(stage, stage.lm_head(stage.transformer.ln_f(h)),
                                              inputs))


# -- Hugging Face Llama: RMSNorm and rotary replicated, grouped-query attention -------------------
def _llama_context(stage, h, inputs):
    pos = _positions(inputs, h)                                            # (1 or B, T)
    return dict(mask=_hf_mask(stage, h, inputs, pos), pos=pos,
                rope=stage.model.rotary_emb(h, position_ids=pos))          # (cos, sin)


def _llama_block(stage, block, h, ctx):
    return _first(block(h, attention_mask=ctx["mask"], position_embeddings=ctx["rope"],
                        position_ids=ctx["pos"]))


_REGISTRY["LlamaForCausalLM"] = ModelPlan(
    blocks="model.layers",
    tp={"model.layers.*.self_attn.q_proj": Split("colwise"),
        "model.layers.*.self_attn.k_proj": Split("colwise"),
        "model.layers.*.self_attn.v_proj": Split("colwise"),
        "model.layers.*.self_attn.o_proj": Split("rowwise"),
        "model.layers.*.mlp.gate_proj": Split("colwise"),
        "model.layers.*.mlp.up_proj": Split("colwise"),
        "model.layers.*.mlp.down_proj": Split("rowwise"),
        "model.embed_tokens": Split("vocab"), "lm_head": Split("vocab_head")},
    heads={},        # its attention reshapes by head_dim (-1 heads): nothing to divide
    regions=("model.layers.*.self_attn", "model.layers.*.mlp"), norm="model.norm",
    first=("model.embed_tokens",), last=("model.norm", "lm_head"), shared=("model.rotary_emb",),
    sizes=lambda m: dict(n_head=m.config.num_attention_heads,
                         n_kv_head=m.config.num_key_value_heads,
                         vocab_size=m.config.vocab_size, n_embd=m.config.hidden_size),
    attention="model.layers.*.self_attn", positions="argument:position_ids",
    inputs=HF_INPUTS, embed=lambda stage, ids, inputs: stage.model.embed_tokens(ids),
    context=_llama_context, block=_llama_block,
    final=lambda stage, h, inputs: _lm_output(stage, stage.lm_head(stage.model.norm(h)), inputs))
