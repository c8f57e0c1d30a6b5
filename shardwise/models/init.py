"""Deterministic, layout-free initialisation, and materialising a meta-device model piece by piece.

A model built on the meta device (``with torch.device("meta")``) has shapes and no values. Each
rank then materialises only what it keeps (its ZeRO-3 shards, its tp slices, its pipeline
stage): :class:`Materializer` makes the whole of one *unit* at a time on the CPU, initialises
it, hands out the pieces asked for and drops the rest, so a rank's peak is one unit plus what it
keeps, never the model. The eager build (:func:`initialize`, ``--init eager``) runs the very same
procedure over every unit of a model already in memory, so both give bit-identical weights.

The choice: **the model's own initialiser, run per module on the CPU generator seeded from
(seed, the module's qualified name)**, via SHA-256 (Python's ``hash`` is salted per process).
Why per module and not per parameter: the initialisers we must reproduce are per module
(Hugging Face's ``_init_weights(module)``, torch's ``reset_parameters()``, our GPT's
``init_module``), and some set a child's tensor from the parent (HF GPT-2 redraws ``c_proj.weight``
with the scaled std from ``GPT2Attention`` / ``GPT2MLP``); a module is the smallest piece whose
initialiser can run alone. Seeding each module on its own makes its values independent of which
other modules exist, are materialised, or in which order, hence of the layout and world size.
Why on the CPU: its generator gives the same numbers on every machine (CUDA's stream is another),
so a unit is initialised on the CPU and the keeper copies its pieces to the device.

Units (:func:`init_units`, fixed by the model alone, never by the layout): each block (the plan's,
else the largest repeated module class) is a unit; every other child holding tensors and no block
is a unit; a module that holds blocks gives its own direct tensors as a *shell* unit, initialised
on a childless copy (its initialiser cannot reach into the blocks). Inside a unit, children are
initialised before their parents, as ``nn.Module.apply`` does.

Tied tensors (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) take the value of the
first unit that holds them (the input embedding, as Hugging Face's ``tie_weights``); a live
tensor is filled with ``torch.utils.swap_tensors``, which keeps the very Parameter object every
module holds, so ties survive materialisation with nothing to re-tie.

Buffers are set by the initialiser too (HF's ``_init_weights`` recomputes Llama's rotary
``inv_freq``; BatchNorm's ``reset_parameters`` its running statistics). Every floating tensor of a
unit is NaN before its initialiser runs; one still NaN after it has no initialiser and is refused
in one line naming the module.

**The contract a user's model (``--model pkg.mod:fn``) meets to be built on the meta device:**
  1. ``__init__`` creates tensors from shapes only: it reads no tensor values (no ``.item()``,
     ``.tolist()``, ``torch.load``, data-dependent branches); otherwise the meta build fails and
     is refused naming the class whose ``__init__`` failed (:func:`build_on_meta`);
  2. every module holding parameters or buffers of its own has ``reset_parameters()`` setting
     all of them (torch's layers do) — our GPT and Hugging Face models use their own
     initialisers instead; shardwise's own modules (LoRA) set themselves;
  3. an initialiser sets its own module's tensors (a block's may set its descendants').
``--init eager`` builds such a model whole on the CPU as before: with (2) met it is initialised
exactly as here; without, it keeps its constructor's weights and every rank starts from rank 0's
(the start-up broadcast stays for every model handed over already materialised).

Memory: one unit's full copy (CPU, the model's dtype) plus the pieces kept; a tp or ZeRO-3 piece
is cut from the unit and the unit dropped before the next one is made.

Values from a checkpoint instead (``--hf-weights``): the Materializer takes a *source*
(models/weights.py) that reads a tensor, a tp slice of it (a :class:`Piece`: row or column
ranges) or a ZeRO-3 shard's element range of it (:meth:`Materializer.flat`) straight from the
safetensors files, so a rank reads only the bytes it keeps and never a whole unit; a tensor the
checkpoint does not hold (non-persistent buffers such as Llama's ``inv_freq``, LoRA adapters)
is still made by the initialiser, as above.
"""
from __future__ import annotations

import copy
import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from shardwise.config import ConfigError
from shardwise.models.plans import block_class, plan_of

Initializer = Callable[[nn.Module, str], None]     # (module, qualified name): set its tensors


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), the same in every process and on every machine."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class Piece:
    """The ranges ``(start, end)`` along ``dim`` of a whole tensor, concatenated in order: a tp
    slice (parallel/tensor.py), which a checkpoint source reads without the rest."""
    dim: int
    ranges: tuple[tuple[int, int], ...]

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        parts = [full.detach().narrow(self.dim, a, b - a) for a, b in self.ranges]
        if len(parts) == 1:
            return parts[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(parts, self.dim)


@dataclass(frozen=True)
class Unit:
    """One piece initialised and materialised at a time (module docstring)."""
    name: str            # its qualified name in the model ("" = the root)
    module: nn.Module
    whole: bool          # True: the module and everything below; False: its own tensors only


def own_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own (not its children's) parameters and buffers, by local name."""
    return [(k, t) for d in (m._parameters, m._buffers) for k, t in d.items() if t is not None]


def unit_tensors(u: Unit) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a unit holds, named from the unit (a tie inside it listed under each name)."""
    if not u.whole:
        return own_tensors(u.module)
    return [*u.module.named_parameters(remove_duplicate=False),
            *u.module.named_buffers(remove_duplicate=False)]


def _block_ids(model: nn.Module) -> set[int]:
    plan = plan_of(model)
    if plan is not None:
        return {id(b) for b in plan.blocks_of(model)}
    cls = block_class(model)
    return {id(m) for m in model.modules() if type(m).__name__ == cls} if cls else set()


def init_units(model: nn.Module) -> list[Unit]:
    """The model's units, in registration order (module docstring)."""
    blocks = _block_ids(model)
    units = [Unit("", model, False)] if own_tensors(model) else []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            q = prefix + name
            if id(child) in blocks:
                units.append(Unit(q, child, True))
            elif any(id(s) in blocks for s in child.modules()):
                if own_tensors(child):
                    units.append(Unit(q, child, False))
                visit(q + ".", child)
            elif any(own_tensors(s) for s in child.modules()):
                units.append(Unit(q, child, True))
    visit("", model)
    return units


# -- the model's own initialiser ---------------------------------------------------------------
def _sets_itself(m: nn.Module) -> bool:
    """A module shardwise adds to any model (LoRA's adapter) that initialises its own tensors."""
    return getattr(type(m), "initialises_itself", False)


def _is_hf(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) \
        and callable(getattr(model, "_init_weights", None))


def initializer_of(model: nn.Module) -> Initializer:
    """Our GPT's ``init_module``; a Hugging Face model's ``_init_weights``; else each module's
    ``reset_parameters()``. shardwise's own modules (LoRA) use their ``reset_parameters``."""
    from shardwise.models.gpt import GPT, init_module
    if isinstance(model, GPT):
        n_layer = model.cfg.n_layer
        return lambda m, name: m.reset_parameters() if _sets_itself(m) else \
            init_module(m, name, n_layer)
    if _is_hf(model):
        return lambda m, name: m.reset_parameters() if _sets_itself(m) else model._init_weights(m)
    return lambda m, name: m.reset_parameters() if own_tensors(m) else None


def check_initialisable(model: nn.Module) -> None:
    """Contract (2) of the module docstring, before anything is allocated: every module with
    tensors of its own has an initialiser. (A Hugging Face model's ``_init_weights`` is trusted
    here; a tensor it leaves unset is caught when its unit is made.)"""
    from shardwise.models.gpt import GPT, initialises
    if _is_hf(model):
        return
    for name, m in model.named_modules():
        tensors = own_tensors(m)
        if not tensors or _sets_itself(m):
            continue
        ok = initialises(m) if isinstance(model, GPT) else callable(
            getattr(m, "reset_parameters", None))
        if not ok:
            cls = type(m).__name__
            raise ConfigError("model.init", "meta", f"module {name or '(root)'!r} ({cls}) holds "
                              f"{', '.join(k for k, _ in tensors)} and has no reset_parameters()"
                              ", so its values cannot be made after a meta-device build",
                              f"give {cls} a reset_parameters() that sets them, or use "
                              "--init eager (every rank builds the whole model)")


# -- making one unit ---------------------------------------------------------------------------
def _copy(u: Unit) -> nn.Module:
    """A copy of the unit's module: the whole subtree, or childless (a shell)."""
    if u.whole:
        return copy.deepcopy(u.module)
    children, u.module._modules = u.module._modules, {}
    try:
        return copy.deepcopy(u.module)
    finally:
        u.module._modules = children


def _fresh(module: nn.Module) -> None:
    """Swap every tensor of ``module`` (meta or real) for a new CPU one: NaN when floating
    (so that one no initialiser sets is seen), else 0. Ties inside it stay ties."""
    done = set()
    for m in module.modules():
        for _, t in own_tensors(m):
            if id(t) in done:
                continue
            done.add(id(t))
            fill = math.nan if t.is_floating_point() else 0
            swap_in(t, torch.full(t.shape, fill, dtype=t.dtype, device="cpu"))


def swap_in(t: torch.Tensor, value: torch.Tensor) -> None:
    """Make the object ``t`` hold ``value`` (a Parameter stays a Parameter, keeps its
    requires_grad and attributes, and every module holding it sees the new value)."""
    new = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else value
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)


def _seed_names(modules: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """The name each module is seeded (and initialised) by: its own, except around a module
    shardwise wrapped (LoRA): the wrapped layer (``<name>.base``) keeps the name it had before
    (so its weights are the unwrapped model's), the wrapper takes ``<name>:adapter``."""
    out = {name: name for name, _ in modules}
    for name, m in modules:
        if _sets_itself(m):
            out[name] = f"{name}:adapter"
            for sub, _ in modules:
                if sub == f"{name}.base" or sub.startswith(f"{name}.base."):
                    out[sub] = name + sub[len(f"{name}.base"):]
    return out


@torch.no_grad()
def make_unit(u: Unit, shell: nn.Module, init: Initializer, seed: int) -> nn.Module:
    """``shell`` (a copy of unit ``u``, meta or real) with fresh CPU tensors, initialised module
    by module, children first, each on the CPU generator seeded from (seed, its name)."""
    _fresh(shell)
    modules = list(shell.named_modules(prefix=u.name)) if u.whole else [(u.name, shell)]
    names = _seed_names(modules)
    for name, m in reversed(modules):          # reverse pre-order: children before parents
        if not own_tensors(m) and not any(own_tensors(s) for s in m.modules()):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_seed(seed, names[name]))
            init(m, names[name])
    for name, m in modules:
        for k, t in own_tensors(m):
            if t.is_floating_point() and torch.isnan(t).any():
                raise ConfigError("model.init", "meta", f"{name}.{k} ({type(m).__name__}) is "
                                  "not set by the model's initialiser (reset_parameters / "
                                  "_init_weights)", f"set it in {type(m).__name__}'s "
                                  "reset_parameters(), or use --init eager")
    return shell


# -- whole models and their pieces -------------------------------------------------------------
class Materializer:
    """Makes the live tensors of a meta-device model (and pieces cut from them) on demand.

    Built on the whole model before anything restructures it (compose.py, step 0): it records,
    for every tensor, the unit holding it and its name there, and keeps a meta copy of each unit
    (no memory). A later split registers how a new tensor derives from an old one
    (:meth:`derive`: tensor parallelism's slices). :meth:`fill` then gives meta tensors their
    values, a unit at a time: the unit is made whole on the CPU (:func:`make_unit`), each tensor
    asked for takes its value (or its slice), and the unit is dropped when the next one is made.
    Peak: one whole unit plus what the caller keeps. With a ``source`` (module docstring:
    ``--hf-weights``), every tensor it holds is read from it instead, piece by piece: no unit is
    made for those."""

    def __init__(self, model: nn.Module, seed: int, snapshot: bool = True, source=None):
        check_initialisable(model)
        self.source = source                       # weights.SafetensorsSource, or None
        self._wrapped = [n for n, m in model.named_modules() if _sets_itself(m)]
        self.seed, self.init = seed, initializer_of(model)
        self.units = init_units(model)
        self.sources: dict[int, tuple] = {}        # id(tensor) -> (unit, name in it, piece)
        self._alive: list[torch.Tensor] = []       # the tensors recorded (their ids stay theirs)
        for i, u in enumerate(self.units):
            for local, t in unit_tensors(u):
                if id(t) not in self.sources:      # tied: the first unit holding it
                    self.sources[id(t)] = (i, local, None)
                    self._alive.append(t)
        # meta copies taken now: tensor parallelism later swaps modules inside the units
        self.copies = [_copy(u) for u in self.units] if snapshot else None
        self._held: tuple[int, dict] | None = None
        self._given: set[tuple[int, str]] = set()   # (unit, name) whose tensor was handed out

    def derive(self, new: torch.Tensor, old: torch.Tensor, piece: Callable | None) -> None:
        """``new`` is ``piece(old)`` (None: all of it)."""
        i, local, first = self.sources[id(old)]
        both = piece if first is None else (first if piece is None else
                                            (lambda full: piece(first(full))))
        self.sources[id(new)] = (i, local, both)
        self._alive.append(new)

    def _unit(self, i: int) -> dict[str, torch.Tensor]:
        """Unit ``i`` made whole on the CPU, by local name (the last one made is held)."""
        if self._held is None or self._held[0] != i:
            self._held = None                      # drop the previous unit first
            self._given = {g for g in self._given if g[0] != i}   # a new copy of unit i
            u = self.units[i]
            shell = copy.deepcopy(self.copies[i]) if self.copies else _copy(u)
            made = make_unit(u, shell, self.init, self.seed)
            self._held = (i, dict(unit_tensors(Unit(u.name, made, u.whole))))
        return self._held[1]

    def name_of(self, t: torch.Tensor) -> str:
        """Recorded tensor ``t``'s name in the model as built (a LoRA-wrapped layer's base
        weight: the name it had before wrapping, which is the checkpoint's)."""
        i, local, _ = self.sources[id(t)]
        name = f"{self.units[i].name}.{local}" if self.units[i].name else local
        for w in self._wrapped:
            if name.startswith(w + ".base."):
                return w + name[len(w) + len(".base"):]
        return name

    def _read(self, t: torch.Tensor) -> str | None:
        """``t``'s name when the source holds it (read from there), else None (initialised)."""
        if self.source is None:
            return None
        name = self.name_of(t)
        return name if self.source.holds(name) else None

    @torch.no_grad()
    def value(self, t: torch.Tensor) -> torch.Tensor:
        """The value of recorded tensor ``t`` (a new CPU tensor)."""
        i, local, piece = self.sources[id(t)]
        name = self._read(t)
        if name is not None:
            return self.source.read(name, piece, t.dtype)
        full = self._unit(i)[local]
        if piece is not None:
            return piece(full)
        if (i, local) in self._given:   # handed out already: a copy (no two share storage)
            return full.clone()
        self._given.add((i, local))     # the unit's own tensor: no copy of a whole unit
        return full

    @torch.no_grad()
    def flat(self, requests: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """``[(t, lo, hi)]`` -> elements ``lo:hi`` of each recorded tensor ``t`` flattened:
        ZeRO-3's shard of a unit (data/zero._own_slice). A source reads only the rows holding
        them; otherwise the unit is made (a unit at a time) and the range cut from it (a view:
        the caller copies it before the next request)."""
        out: list = [None] * len(requests)
        for k in sorted(range(len(requests)), key=lambda k: self.sources[id(requests[k][0])][0]):
            t, lo, hi = requests[k]
            name = self._read(t)
            if name is not None:
                out[k] = self.source.read_flat(name, self.sources[id(t)][2], lo, hi, t.dtype)
            else:
                out[k] = self.value(t).reshape(-1)[lo:hi]
        return out

    def fill(self, tensors) -> None:
        """Give every meta tensor among ``tensors`` its value, on the CPU, unit by unit."""
        todo = {id(t): t for t in tensors if t is not None and t.is_meta}
        for t in sorted(todo.values(), key=lambda t: self.sources[id(t)][0]):
            swap_in(t, self.value(t))

    def fill_module(self, module: nn.Module) -> None:
        """Every meta parameter and buffer of ``module``."""
        self.fill([*module.parameters(), *module.buffers()])

    def release(self) -> None:
        """Drop the unit held and close the source's files (their mapped pages go too)."""
        self._held = None
        if self.source is not None:
            self.source.close()


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """The eager path: set every tensor of a model in memory exactly as materialising it from
    the meta device does (unit by unit; one unit's copy at a time)."""
    m = Materializer(model, seed, snapshot=False)
    for i, u in enumerate(m.units):
        for _, t in unit_tensors(u):
            if m.sources[id(t)][0] == i and not t.is_meta:
                t.copy_(m.value(t))
    m.release()


def build_on_meta(construct: Callable[[], nn.Module], name: str) -> nn.Module:
    """``construct()`` under ``torch.device("meta")``; a constructor that needs real tensors
    (contract (1)) is refused in one line naming the class whose ``__init__`` failed."""
    try:
        with torch.device("meta"):
            return construct()
    except ConfigError:
        raise
    except Exception as exc:             # the person's code: any error, one line
        where = _failing_init(sys.exc_info()[2]) or name
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        raise ConfigError("model.name", name, f"{where}.__init__ needs real tensors (building "
                          f"on the meta device fails there: {why})", "create parameters from "
                          "shapes only in __init__ and set their values in reset_parameters(),"
                          " or use --init eager (every rank builds the whole model)") from None


def _failing_init(tb) -> str | None:
    """The class of the innermost ``nn.Module.__init__`` on the traceback."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(owner, nn.Module):
            found = type(owner).__name__
        tb = tb.tb_next
    return found
