"""Flat parameters: the encoder layers' parameters held in two flat tensors, the decayed ones and the others.

Why: DeepSpeed's ZeRO 0-2 and the fused AdamW do host work per parameter tensor (gradient hooks, bucket copies,
norms, casts, views): a BERT layer's 16 tensors become 2 (train.flat_scope=layer), or all layers' together 2
(=encoder, the default), and a BERT-base step dispatches ~3,000 (~3,400) fewer ops (``tools/bench_step.py
--host-cost``). The arithmetic is unchanged: every original parameter is a view of its flat tensor, made at the
forward (``torch.split`` + ``view``; their backward is one ``cat``), so losses, gradients and updates equal the
per-tensor layout's (tests/test_flat_params.py). The state dict keeps the per-tensor names (``attn.q.weight``,
...) both ways, so checkpoints' ``model.safetensors``, ``init_from``, the Hugging Face export and the evaluation
tools see the usual model. DeepSpeed's own files name the flat tensors (``encoder.layers.flat_decay``, or
``encoder.layers.0.flat_decay`` a layer); ``unflatten_state`` (with the layout the checkpoint records,
``layout_of``) turns what its readers return back into per-tensor names.

The flat tensors are registered on the unit (the layers' ``ModuleList``, or each layer), which owns them for ZeRO's
purposes; ZeRO-3 (which partitions and gathers per module, and would free the storage the views hold) keeps the
per-tensor layout.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

FLAT_KINDS = ("decay", "no_decay")
"""The flat tensors of a flattened layer: ``flat_decay`` (weight matrices) and ``flat_no_decay`` (biases, norms)."""


def is_decayed(name: str, p: torch.Tensor) -> bool:
    """AdamW's weight decay applies to weight matrices, not to biases, norms or other 1-d parameters."""
    return p.ndim >= 2 and not name.endswith(".bias") and "norm" not in name.lower()


class _Slot:
    """One original parameter inside a flat tensor: the module that used to own it and its attribute name."""

    __slots__ = ("name", "owner", "attr", "shape", "numel")

    def __init__(self, name: str, owner: nn.Module, attr: str, shape: torch.Size) -> None:
        self.name, self.owner, self.attr, self.shape, self.numel = name, owner, attr, shape, shape.numel()


def flatten_unit(unit: nn.Module) -> None:
    """Moves ``unit``'s parameters (all of them, in ``named_parameters`` order) into ``unit.flat_decay`` and
    ``unit.flat_no_decay``; each original attribute becomes a view, remade by ``materialize`` at every forward.
    The values, their order and ``requires_grad`` are kept. Tied or shared parameters are refused."""
    if getattr(unit, "_flat_slots", None) is not None:
        return
    params = list(unit.named_parameters())
    if len(params) != len(list(unit.named_parameters(remove_duplicate=False))):
        raise ValueError(f"{type(unit).__name__} shares a parameter between two of its modules: it cannot be "
                         f"flattened (set train.flat_params=false)")
    unit._flat_order = list(unit.state_dict(keep_vars=True))  # the per-tensor state dict's key order
    slots: dict[str, list[_Slot]] = {kind: [] for kind in FLAT_KINDS}
    values: dict[str, list[torch.Tensor]] = {kind: [] for kind in FLAT_KINDS}
    grad = {p.requires_grad for _, p in params}
    for name, p in params:
        *path, attr = name.split(".")
        owner = unit.get_submodule(".".join(path))
        kind = "decay" if is_decayed(name, p) else "no_decay"
        slots[kind].append(_Slot(name, owner, attr, p.shape))
        values[kind].append(p.detach().reshape(-1))
        del owner._parameters[attr]
    for kind in FLAT_KINDS:
        if values[kind]:
            flat = nn.Parameter(torch.cat(values[kind]), requires_grad=grad == {True})
            unit.register_parameter(f"flat_{kind}", flat)
    unit._flat_slots = {kind: s for kind, s in slots.items() if s}
    unit._flat_segments, unit._flat_spans = _plan(unit, unit._flat_slots)
    unit._flat_key = next(_KEYS)
    _TRACED_PLANS[unit._flat_key] = _traced_plan_of(unit)
    unit._flat_cache = None
    unit.register_state_dict_post_hook(_state_dict_per_tensor)
    unit.register_load_state_dict_pre_hook(_load_per_tensor)
    materialize(unit)
    unit._flat_cache = None  # the first forward makes its own views, as every later one (release_views)


FLAT_SCOPES = ("encoder", "layer")
"""train.flat_scope: one pair of flat tensors for all the encoder's layers (``encoder.layers.flat_decay``), or a
pair per layer (``encoder.layers.0.flat_decay``, ...)."""


def flatten_layers(model: nn.Module, scope: str = "encoder") -> int:
    """The model's encoder layers' parameters flat (``flatten_unit``): ``scope`` "encoder" flattens the layers'
    ``ModuleList`` as one unit (the encoder materializes its views once a forward: ``Encoder._layers``), "layer"
    each layer on its own (each layer at its forward). Returns how many parameter tensors it removed.

    Why a single pair: ZeRO 1-2 hook, copy, bucket and update each parameter tensor in Python (~20 aten ops and a
    gradient hook each); BERT-base's 12 layers as 24 flat tensors still left 40 tensors a step, as one pair 18
    (docs/performance.md). The layers' gradients then reach the flat tensor together, as one ``cat`` at the end of
    the encoder's backward rather than one a layer: the same bytes, and with the gradient bucket at the model's size
    (distributed/ds_config.py) DeepSpeed reduces once a micro-step either way."""
    if scope not in FLAT_SCOPES:
        raise ValueError(f"train.flat_scope={scope!r}: expected one of {', '.join(FLAT_SCOPES)}")
    before = sum(1 for _ in model.parameters())
    units = (model.encoder.layers,) if scope == "encoder" else tuple(model.encoder.layers)
    for unit in units:
        flatten_unit(unit)
    model._flat_units = units  # what release_views resets, without a walk per forward
    return before - sum(1 for _ in model.parameters())


class _Segment:
    """One piece of a flat tensor as ``materialize`` splits it: one parameter (``slot``), or the consecutive
    parameters of a ``FLAT_SPANS`` group viewed as one tensor of their rows (``members``: each parameter with its
    rows in it)."""

    __slots__ = ("numel", "shape", "slot", "members")

    def __init__(self, numel: int, shape: tuple, slot: _Slot | None = None,
                 members: list[tuple[_Slot, int, int]] | None = None) -> None:
        self.numel, self.shape, self.slot, self.members = numel, shape, slot, members


def _plan(unit: nn.Module, slots: dict[str, list[_Slot]]) -> tuple[dict[str, list[_Segment]], list[tuple]]:
    """How ``materialize`` splits each flat tensor, and what the unit's ``FLAT_SPANS`` targets get.

    ``FLAT_SPANS`` ({"attn.qkv_span": (("attn.q.weight", "attn.k.weight", "attn.v.weight"), (... biases))}): each
    target gets a tuple of tensors, each one view over consecutive parameters of one flat tensor (concatenated along
    dim 0), e.g. a fused q/k/v projection. Such a group is one segment of the split, and its parameters are views of
    that segment, so that the fused projection's gradient reaches the flat tensor through the split's backward
    alone: a ``narrow`` of the flat tensor beside the split would add, to every backward, a zero tensor of the whole
    flat tensor's size, a copy into it and a sum per group.

    Returns ({kind: [_Segment]}, [(owner, attr, [(kind, segment index)])])."""
    targets = _span_groups(unit, slots)
    groups = {(kind, first): last for _, _, pieces in targets for kind, first, last in pieces}
    segments, index_of = _segments(slots, groups)
    spans = [(owner, attr, [(kind, index_of[(kind, first)]) for kind, first, _ in pieces])
             for owner, attr, pieces in targets]
    return segments, spans


def _span_groups(unit: nn.Module, slots: dict[str, list[_Slot]]) -> list[tuple]:
    """The ``FLAT_SPANS`` targets that can be served: [(owner, attr, [(kind, first slot index, last)])]. A group
    whose parameters are not consecutive in one flat tensor, differ in their trailing dimensions or belong to an
    earlier group leaves its target out (it stays None)."""
    where = {slot.name: (kind, i, slot) for kind, kind_slots in slots.items() for i, slot in enumerate(kind_slots)}
    taken: set[tuple[str, int]] = set()  # (kind, slot index) of every parameter in a group
    targets = []
    for target, groups in _unit_spans(unit):
        pieces, mine = [], set()
        for names in groups:
            found = [where.get(n) for n in names]
            if None in found or len({f[0] for f in found}) != 1:
                break
            kind, first = found[0][0], found[0][1]
            indices = [f[1] for f in found]
            keys = {(kind, i) for i in indices}
            if indices != list(range(first, first + len(found))) or keys & (taken | mine) or \
                    len({tuple(f[2].shape[1:]) for f in found}) != 1:
                break
            mine |= keys
            pieces.append((kind, first, indices[-1]))
        else:
            taken |= mine
            *path, attr = target.split(".")
            targets.append((unit.get_submodule(".".join(path)), attr, pieces))
    return targets


def _unit_spans(unit: nn.Module) -> list[tuple[str, tuple]]:
    """The ``FLAT_SPANS`` of every module in ``unit`` (the unit itself, a layer, or each layer of a ``ModuleList``
    of them), with targets and parameter names relative to ``unit``."""
    out = []
    for prefix, module in unit.named_modules():
        at = f"{prefix}." if prefix else ""
        out += [(at + target, tuple(tuple(at + n for n in names) for names in groups))
                for target, groups in getattr(module, "FLAT_SPANS", {}).items()]
    return out


def _segments(slots: dict[str, list[_Slot]], groups: dict[tuple[str, int], int]):
    """Each flat tensor's segments in order: one per parameter, one per span group ``groups`` ((kind, first slot
    index) -> last), whose members are row ranges of its view. Returns (segments, (kind, first) -> segment index)."""
    segments: dict[str, list[_Segment]] = {}
    index_of: dict[tuple[str, int], int] = {}
    for kind, kind_slots in slots.items():
        segments[kind] = []
        i = 0
        while i < len(kind_slots):
            if (kind, i) not in groups:
                slot = kind_slots[i]
                segments[kind].append(_Segment(slot.numel, tuple(slot.shape), slot=slot))
                i += 1
                continue
            group, members, row = kind_slots[i:groups[(kind, i)] + 1], [], 0
            for slot in group:
                members.append((slot, row, row + slot.shape[0]))
                row += slot.shape[0]
            index_of[(kind, i)] = len(segments[kind])
            segments[kind].append(_Segment(sum(s.numel for s in group), (row, *group[0].shape[1:]), members=members))
            i += len(group)
    return segments, index_of


_KEYS = itertools.count()
_TRACED_PLANS: dict[int, tuple] = {}
"""``unit._flat_key`` -> the unit's plan as constants (``_traced_plan_of``), what a traced ``materialize`` reads.
Entries stay for the process (a few hundred names and numbers per layer flattened), so that a copy of a unit, which
keeps its key, still finds its plan."""


def _traced_plan_of(unit: nn.Module) -> tuple:
    """The unit's ``_flat_segments`` and ``_flat_spans`` as nested tuples of names and numbers, for the traced
    ``materialize`` and ``forget_traced_views``: ((kind, split sizes, view shapes, ((segment index, owner path,
    attr, first row or None, end row), ...)), ...) and ((owner path, attr, ((kind, segment index), ...)), ...); an
    owner path is the names from the unit down to the module."""
    paths = {id(m): tuple(name.split(".")) if name else () for name, m in unit.named_modules()}
    kinds = tuple(
        (kind, tuple(seg.numel for seg in segments), tuple(tuple(seg.shape) for seg in segments),
         tuple((i, paths[id(slot.owner)], slot.attr, start, end) for i, seg in enumerate(segments)
               for slot, start, end in seg.members or [(seg.slot, None, None)]))
        for kind, segments in unit._flat_segments.items())
    spans = tuple((paths[id(owner)], attr, tuple(refs)) for owner, attr, refs in unit._flat_spans)
    return kinds, spans


def _traced_plan(key: int) -> tuple:
    """``_TRACED_PLANS[key]``; a constant to torch.compile once ``mark_plans_constant`` has run."""
    return _TRACED_PLANS[key]


def mark_plans_constant() -> None:
    """Makes ``_traced_plan`` a constant to torch.compile (``assume_constant_result``): a trace reads a layer's plan
    without a guard on each of its numbers and names (about 3,000 guards at BERT-base depth, evaluated before every
    call of the compiled step: about 1 ms of its host time, docs/performance.md); the unit's key is guarded, and the
    plan never changes after ``flatten_unit``. Called before compiling (``TrainModule.compile_step``), not at
    import, which would import torch._dynamo into every eager run. Without it a trace reads the plan entry by
    entry: the same graph, with the guards."""
    torch.compiler.assume_constant_result(_traced_plan)


def _owner(unit: nn.Module, path: tuple) -> nn.Module:
    for name in path:
        unit = getattr(unit, name)
    return unit


def release_views(model: nn.Module) -> None:
    """Drops the cached parameter views of the model's flattened layers (``flatten_layers``): their next forward
    makes new ones. Called at the start of every training forward (TrainModule.forward), so that each micro-step's
    graph has views of its own. A view kept from an earlier step carries that step's autograd node, whose older
    sequence number changes the order in which the backward reaches the gradients (and so DeepSpeed's bucketing and, on
    more than two ranks, the rounding of their reduction): a resumed run, whose views are new, would then differ
    from the uninterrupted one in the last bit. DeepSpeed updates its flat buffer in place through tensors that
    do not share the parameters' version counters, so the cache key alone does not end a view's life."""
    for unit in getattr(model, "_flat_units", ()):  # set by flatten_layers; () for a per-tensor model
        unit._flat_cache = None


def materialize(unit: nn.Module) -> None:
    """Sets each original parameter attribute of a flattened ``unit`` to its view of the flat tensors (a no-op
    for a unit that is not flattened). The views are made once per (storage, version, grad mode) and reused by
    the micro-step's other forwards until ``release_views``; traced by torch.compile, they are made inside the
    graph."""
    if torch.compiler.is_compiling():
        _materialize_traced(unit)
        return
    slots = getattr(unit, "_flat_slots", None)
    if slots is None:
        return
    flats = {kind: getattr(unit, f"flat_{kind}") for kind in slots}
    key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
           tuple((f.data_ptr(), f._version, f.dtype, f.device) for f in flats.values()))
    if unit._flat_cache == key:
        return
    # The views go straight into the owners' __dict__: what nn.Module.__setattr__ ends in for a plain tensor whose
    # name is no parameter, buffer or submodule (flatten_unit removed the parameter), without its checks (~5 us
    # each, 17 a BERT layer, a tenth of a BERT-base-depth step's host time).
    # A 1-d segment (a bias, a norm's weight, a span of biases) is its split part as it is: a view on top would be
    # one more op forward and one more autograd node backward, for each of them (8 of a BERT layer's 12 segments).
    views = {}
    for kind, segments in unit._flat_segments.items():
        views[kind] = [part if len(seg.shape) == 1 else part.view(seg.shape) for seg, part in
                       zip(segments, torch.split(flats[kind], [seg.numel for seg in segments]))]
        for seg, view in zip(segments, views[kind]):
            if seg.members is None:
                _put(seg.slot.owner, seg.slot.attr, view)
            else:  # a span's parameters: row ranges of its one view
                for slot, start, end in seg.members:
                    _put(slot.owner, slot.attr, view[start:end])
    for owner, attr, refs in unit._flat_spans:
        _put(owner, attr, tuple(views[kind][i] for kind, i in refs))
    unit._flat_cache = key


def _materialize_traced(unit: nn.Module) -> None:
    """``materialize`` inside torch.compile: the same views from the unit's constant plan (``_traced_plan``),
    set with setattr on owners reached by name from the unit."""
    key = getattr(unit, "_flat_key", None)
    if key is None:
        return
    kinds, spans = _traced_plan(key)
    views = {}
    for kind, sizes, shapes, puts in kinds:
        views[kind] = [part.view(shape) for part, shape in
                       zip(torch.split(getattr(unit, f"flat_{kind}"), sizes), shapes)]
        for i, path, attr, start, end in puts:
            setattr(_owner(unit, path), attr, views[kind][i] if start is None else views[kind][i][start:end])
    for path, attr, refs in spans:
        setattr(_owner(unit, path), attr, tuple(views[kind][i] for kind, i in refs))


def _put(owner: nn.Module, attr: str, value) -> None:
    owner.__dict__[attr] = value


def forget_traced_views(unit: nn.Module) -> None:
    """Inside torch.compile, at the end of a flattened ``unit``'s forward: its parameter attributes set to None
    (a no-op in eager, where ``materialize`` keeps its views for the micro-step's other forwards). Otherwise every
    view made inside the graph is a graph output, and after each call AOTAutograd regenerates it as an alias of
    its flat tensor and Dynamo sets it on its module: 17 views a BERT layer, about a quarter of a compiled step's
    host time at BERT-base depth (docs/performance.md). The backward does not read the attributes."""
    if not torch.compiler.is_compiling():
        return
    key = getattr(unit, "_flat_key", None)
    if key is None:
        return
    kinds, spans = _traced_plan(key)
    for path, attr in [(path, attr) for *_, puts in kinds for _, path, attr, _, _ in puts] + \
            [(path, attr) for path, attr, _ in spans]:
        setattr(_owner(unit, path), attr, None)
    unit._flat_cache = None  # an eager forward after this one makes its views again


def _state_dict_per_tensor(unit: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: each flat tensor's entry becomes its parameters' entries (copies, so that a saved state
    does not carry the whole flat storage per key), in the per-tensor model's order."""
    entries = {}
    for kind, kind_slots in unit._flat_slots.items():
        flat = state.pop(prefix + f"flat_{kind}", None)
        if flat is None:
            continue
        for slot, part in zip(kind_slots, torch.split(flat, [s.numel for s in kind_slots])):
            entries[slot.name] = part.view(slot.shape).clone()
    for name in unit._flat_order:  # the unit's entries are the last ones so far: re-added in order
        value = entries.pop(name, None) if name in entries else state.pop(prefix + name, None)
        if value is not None:
            state[prefix + name] = value


def _load_per_tensor(unit: nn.Module, state: dict, prefix: str, local_metadata, strict: bool,
                     missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook: per-tensor entries are put together into the flat tensors' entries. A tensor the
    state lacks keeps its current value and is reported missing; a wrong shape is reported by name."""
    for kind, kind_slots in unit._flat_slots.items():
        key = prefix + f"flat_{kind}"
        if key in state:
            continue
        current = torch.split(getattr(unit, f"flat_{kind}").detach(), [s.numel for s in kind_slots])
        parts = []
        for slot, now in zip(kind_slots, current):
            value = state.pop(prefix + slot.name, None)
            if value is None:
                missing_keys.append(prefix + slot.name)
                value = now
            elif tuple(value.shape) != tuple(slot.shape):
                error_msgs.append(f"size mismatch for {prefix + slot.name}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                                  f"{tuple(slot.shape)}.")
                value = now
            parts.append(value.reshape(-1).to(now.dtype))
        state[key] = torch.cat(parts)


def layout_of(model: nn.Module) -> dict[str, list[list]]:
    """Every flat tensor's key in the model's state (as DeepSpeed names it) -> its parts' [name, shape] in order;
    {} for a model without flattened layers. Recorded with each checkpoint for ``unflatten_state``."""
    layout = {}
    for prefix, unit in model.named_modules():
        for kind, kind_slots in (getattr(unit, "_flat_slots", None) or {}).items():
            key = f"{prefix}.flat_{kind}" if prefix else f"flat_{kind}"
            layout[key] = [[s.name, list(s.shape)] for s in kind_slots]
    return layout


def unflatten_state(state: dict, layout: dict[str, list[list]], *, prefix: str = "") -> dict:
    """A state dict whose flat entries (``layout_of``'s keys, under ``prefix``) are split into per-tensor
    entries; other entries as they are. A flat entry whose size does not fit its layout is a ValueError."""
    out = {}
    for key, value in state.items():
        parts = layout.get(key[len(prefix):]) if key.startswith(prefix) else None
        if parts is None:
            out[key] = value
            continue
        sizes = [int(torch.Size(shape).numel()) for _, shape in parts]
        if value.numel() != sum(sizes):
            raise ValueError(f"{key} holds {value.numel()} values, its recorded layout {sum(sizes)}: the "
                             f"checkpoint's flat_layout.json does not belong to its weights")
        unit_prefix = key[: key.rindex("flat_")]
        for (name, shape), part in zip(parts, torch.split(value.reshape(-1), sizes)):
            out[unit_prefix + name] = part.view(shape).clone()
    return out
