"""train.flat_params (model/flat.py): the encoder layers' parameters in two flat tensors (train.flat_scope=encoder)
or two a layer (=layer), same model.

The flattened model must compute what the per-tensor one computes: the same hidden states, losses and gradients
(padded and unpadded), the same state dict (names and values) both ways, AdamW's decay on the same values. The
fused q/k/v matmul sums each output over the same D inputs as the three separate ones; only the blocking of the
matmul may differ, so forward values are compared at fp32 rounding (1e-6 of order-1 entries) and gradients at
1e-5 of their largest entry (the key bias's gradient is 0 in exact arithmetic, rounding noise in both).
"""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ModelConfig, ObjectiveConfig, OpsConfig
from pretrain.config.objective import MLMConfig, NTXentConfig
from pretrain.distributed.env import single_process_env
from pretrain.model import build_model
from pretrain.model.flat import _Segment, flatten_layers, layout_of, materialize, unflatten_state
from pretrain.objective import Context, Objective, TrainModule
from pretrain.training.optim import build_param_groups
from pretrain.training.step import host_facts


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
                dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**base, **kw})


SCOPES = ["encoder", "layer"]


def _module(flat: bool, scope: str = "encoder", **kw) -> TrainModule:
    model = build_model(_cfg(**kw), seed=0)
    ctx = Context(env=single_process_env(), ops=OpsConfig(), pooling="mean")
    module = TrainModule(model, Objective(ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(gather=False)), ctx))
    if flat:
        flatten_layers(module.model, scope)
    return module


def _units(module) -> list:
    """The modules that hold the flat tensors: the layers' ModuleList, or each layer."""
    return [m for m in module.model.encoder.modules() if getattr(m, "_flat_slots", None)]


def _batch() -> dict:
    gen = torch.Generator().manual_seed(0)

    def rows(lengths, width):
        ids = torch.randint(5, 50, (len(lengths), width), generator=gen)
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return ids.masked_fill(~mask, 0), mask

    ids, mask = rows([64, 9, 40, 64], 64)
    labels = torch.where(mask & (torch.rand(mask.shape, generator=gen) < 0.3), ids, -100)
    labels[:, 1] = ids[:, 1]
    (va, ma), (vb, mb) = rows([20, 3, 32, 7], 32), rows([32, 5, 11, 30], 32)
    return dict(input_ids=ids, attention_mask=mask, mlm_labels=labels, view_a_ids=va, view_a_mask=ma,
                view_b_ids=vb, view_b_mask=mb)


def _loss_and_grads(module, unpadded: bool):
    module.zero_grad(set_to_none=True)
    loss, _ = module(host_facts(_batch(), unpadded=unpadded))
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), unflatten_state(grads, layout_of(module))


@pytest.mark.parametrize("scope", SCOPES)
def test_a_layer_becomes_two_tensors_and_the_state_dict_keeps_its_names(scope):
    per_tensor, flat = _module(False), _module(True, scope)
    names = {n for n, _ in flat.named_parameters() if "encoder.layers." in n}
    units = ["model.encoder.layers"] if scope == "encoder" else [f"model.encoder.layers.{i}" for i in (0, 1)]
    assert names == {f"{u}.flat_{k}" for u in units for k in ("decay", "no_decay")}
    assert sum(1 for _ in per_tensor.parameters()) - sum(1 for _ in flat.parameters()) == 2 * 16 - 2 * len(units)
    a, b = per_tensor.state_dict(), flat.state_dict()
    assert list(a) == list(b)  # names and their order
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert b[k].untyped_storage().nbytes() == b[k].numel() * b[k].element_size(), f"{k} carries the flat storage"


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("unpadded", [False, True])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_losses_and_gradients_equal_the_per_tensor_model(unpadded, norm, scope):
    loss_a, grads_a = _loss_and_grads(_module(False, norm=norm), unpadded)
    loss_b, grads_b = _loss_and_grads(_module(True, scope, norm=norm), unpadded)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 30
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=0, atol=1e-5 * float(g.abs().max()) + 1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_the_comparison_sees_a_span_off_by_one_matrix():
    """The check above fails when the fused q/k/v span is misplaced (its weights start one D x D matrix late)."""
    _, grads_a = _loss_and_grads(_module(False), True)
    flat = _module(True, "layer")
    for layer in flat.model.encoder.layers:  # the span's segment one matrix late: k, v and out instead of q, k, v
        (span, out, *rest) = layer._flat_segments["decay"]
        (q, _, _), (k, _, _), (v, _, _) = span.members
        d = q.shape[0]
        layer._flat_segments["decay"] = [
            _Segment(q.numel, tuple(q.shape), slot=q),
            _Segment(span.numel, span.shape, members=[(k, 0, d), (v, d, 2 * d), (out.slot, 2 * d, 3 * d)]), *rest]
        owner, attr, (weights, bias) = layer._flat_spans[0]
        layer._flat_spans = [(owner, attr, [("decay", 1), bias])]
        layer._flat_cache = None
    _, grads_b = _loss_and_grads(flat, True)
    far = [n for n, g in grads_a.items() if not torch.allclose(grads_b[n], g, rtol=0, atol=1e-3 * float(g.abs().max()))]
    assert "model.encoder.layers.0.attn.q.weight" in far and len(far) > 10


@pytest.mark.parametrize("scope", SCOPES)
def test_the_fused_span_reaches_its_flat_tensor_through_the_split_alone(scope):
    """The q/k/v span is one segment of the flat tensor's split, so its gradient needs no flat-sized zero tensor:
    a narrow of the flat tensor beside the split made one (slice_backward), plus a zero part for each of q, k and v
    in the split's backward and a sum, in every layer of every step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    module = _module(True, scope)
    flat_sizes = {p.numel() for p in module.model.encoder.layers.parameters()}
    made = []  # the size of every tensor the backward fills with zeros: slice_backward's input, zeros

    class Zeros(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("slice_backward", "zeros", "new_zeros"):
                made.append((name, int(torch.Size(args[1] if name != "zeros" else args[0]).numel())))
            return func(*args, **(kwargs or {}))

    loss, _ = module(host_facts(_batch(), unpadded=True))
    with Zeros():
        loss.backward()
    assert not [m for m in made if m[1] in flat_sizes], made
    unused = [m for m in made if m[0] == "zeros" and m[1] in (32 * 32, 32)]  # q, k, v's own parts of the split
    assert not unused, unused
    for layer in module.model.encoder.layers:  # the attributes are still views of the flat tensors
        weight, bias = layer.attn.qkv_span
        assert layer.attn.k.weight.data_ptr() == weight.data_ptr() + weight[:32].numel() * weight.element_size()
        assert torch.equal(layer.attn.v.bias, bias[64:]) and layer.attn.q.weight.grad_fn is not None


def test_loading_moves_values_both_ways_and_names_what_is_missing_or_misshapen():
    per_tensor = _module(False)
    other = build_model(_cfg(), seed=1)
    flatten_layers(other)
    other.load_state_dict(per_tensor.model.state_dict())
    for k, v in per_tensor.model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    back = build_model(_cfg(), seed=2)
    back.load_state_dict(other.state_dict())  # flat -> per tensor
    assert all(torch.equal(back.state_dict()[k], v) for k, v in per_tensor.model.state_dict().items())
    state = per_tensor.model.state_dict()
    kept = other.state_dict()["encoder.layers.1.attn.k.bias"].clone()
    del state["encoder.layers.1.attn.k.bias"]
    state["encoder.layers.0.ffn.up.weight"] = torch.zeros(3, 3)
    fresh = build_model(_cfg(), seed=3)
    flatten_layers(fresh)
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder\.layers\.0\.ffn\.up\.weight"):
        fresh.load_state_dict(state)
    del state["encoder.layers.0.ffn.up.weight"]
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert "encoder.layers.1.attn.k.bias" in missing and "encoder.layers.0.ffn.up.weight" in missing
    assert not unexpected and not any("flat_" in k for k in missing)
    assert torch.equal(other.state_dict()["encoder.layers.1.attn.k.bias"], kept)  # left as it was


def test_weight_decay_falls_on_the_same_values():
    def decayed_numel(module):
        groups = build_param_groups(module, 0.01)
        return [sum(p.numel() for p in g["params"]) for g in groups], [g["weight_decay"] for g in groups]

    assert decayed_numel(_module(True)) == decayed_numel(_module(False))


def test_unflatten_state_refuses_a_layout_that_does_not_fit():
    flat = _module(True)
    layout = layout_of(flat)
    state = {n: p.detach() for n, p in flat.named_parameters()}
    assert set(unflatten_state(state, layout)) == {n for n, _ in _module(False).named_parameters()}
    state["model.encoder.layers.flat_decay"] = state["model.encoder.layers.flat_decay"][:-1]
    with pytest.raises(ValueError, match="flat_layout.json does not belong"):
        unflatten_state(state, layout)


@pytest.mark.parametrize("scope", SCOPES)
def test_views_follow_an_in_place_update_and_a_new_storage(scope):
    flat = _module(True, scope)
    (unit, *_), layer = _units(flat), flat.model.encoder.layers[0]
    with torch.no_grad():
        unit.flat_decay.add_(1.0)
    materialize(unit)
    assert torch.equal(layer.attn.q.weight, flat.model.state_dict()["encoder.layers.0.attn.q.weight"])
    unit.flat_decay.data = unit.flat_decay.data.to(torch.bfloat16)  # what DeepSpeed's bf16 cast does
    materialize(unit)
    assert layer.attn.q.weight.dtype == torch.bfloat16
    assert layer.attn.q.weight.data_ptr() == unit.flat_decay.data_ptr()


@pytest.mark.parametrize("scope", SCOPES)
def test_every_unit_remakes_its_views_at_a_training_forward(scope):
    """DeepSpeed's bf16 cast gives the flat tensors new storage after flatten_layers made their first views: each
    unit's views must be made again at the forward (the encoder's for all layers, or each layer's at its own), or
    the layers would compute with the old storage. After one forward every parameter attribute views its unit's
    current flat tensor."""
    module = _module(True, scope)
    units = _units(module)
    assert len(units) == (1 if scope == "encoder" else 2)
    for unit in units:
        for kind in unit._flat_slots:
            flat = getattr(unit, f"flat_{kind}")
            flat.data = flat.data.clone()  # a new storage, as DeepSpeed's .data = .data.to(bf16)
    module(host_facts(_batch(), unpadded=True))
    for unit in units:
        for kind, slots in unit._flat_slots.items():
            flat = getattr(unit, f"flat_{kind}")
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            for slot in slots:
                assert lo <= slot.owner.__dict__[slot.attr].data_ptr() < hi, f"{slot.name} views an old storage"


@pytest.mark.parametrize("scope", SCOPES)
def test_materialize_views_only_the_matrices(scope):
    """A 1-d parameter (a bias, a norm's weight, the q/k/v biases' span) is its split part as it is; only the
    matrices get a view (each view is one more op forward and one more autograd node backward)."""
    from pretrain.metrics.op_count import OpCounter

    module = _module(True, scope)
    units = _units(module)
    for unit in units:
        unit._flat_cache = None
    with OpCounter() as counter:
        for unit in units:
            materialize(unit)
    matrices = sum(len(seg.shape) > 1 for unit in units for segs in unit._flat_segments.values() for seg in segs)
    # a layer's matrices: the q/k/v span, out, up, down
    assert matrices == 2 * 4 and counter.ops["aten.view"] == matrices, counter.ops
    layer = module.model.encoder.layers[1]
    assert type(layer.attn_norm.weight.grad_fn).__name__.startswith("SplitWithSizesBackward")
    assert type(layer.ffn.up.weight.grad_fn).__name__.startswith("ViewBackward")


def _grad_order(module, steps: int) -> list[list[str]]:
    """The order in which each step's backward accumulates the parameters' gradients."""
    order: list[str] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
             for n, p in module.named_parameters()]
    out = []
    for _ in range(steps):
        order.clear()
        loss, _ = module(host_facts(_batch(), unpadded=False))
        loss.backward()
        for p in module.parameters():  # an update as DeepSpeed's: in place, by a tensor not sharing the version
            if p.grad is not None:
                p.data.sub_(1e-3 * p.grad)
                p.grad = None
        out.append(list(order))
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("scope", SCOPES)
def test_every_step_backward_reaches_the_gradients_in_the_first_steps_order(monkeypatch, scope):
    """Views kept from an earlier step carry its autograd nodes, whose older sequence numbers reorder the next
    backward (DeepSpeed buckets gradients in that order; on 4 ranks a resumed run then differed from the
    uninterrupted one in the last bit). TrainModule.forward releases them, so every step's order is the first
    step's, which is also the order of a resumed run's first step; without the release it is not."""
    import pretrain.objective as objective_mod

    first, *later = _grad_order(_module(True, scope), steps=3)
    assert all(o == first for o in later), (first, later)
    monkeypatch.setattr(objective_mod, "release_views", lambda model: None)
    kept_first, *kept_later = _grad_order(_module(True, scope), steps=3)
    assert kept_first == first and any(o != first for o in kept_later), "the kept views no longer reorder: " \
        "is release_views still needed?"


ARCHS = {"bert": {}, "modernbert": {"arch": "modernbert", "pooler": False, "local_window": 16}}


def _compiled_step(num_layers: int, scope: str, arch: str, guards: list | None = None) -> dict:
    """One compiled training forward + backward of a flattened module: {"outputs": outputs of each graph Dynamo
    hands its backend, "loss", "grads", "module": the compiled module}; ``guards`` (a list) gets the name of each
    guard torch.compile's guard_filter_fn is shown (all kept)."""
    module = _module(True, scope, num_layers=num_layers, **ARCHS[arch])
    outputs = []

    def backend(gm, example_inputs):
        outputs.append(len(next(n for n in gm.graph.nodes if n.op == "output").args[0]))
        return gm.forward

    def record(entries):
        guards.extend(e.name for e in entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    module.compile_step(backend=backend, options={"guard_filter_fn": record} if guards is not None else None)
    module.train()
    loss, _ = module(host_facts(_batch(), unpadded=False))
    loss.backward()
    return {"outputs": outputs, "loss": loss.detach(), "module": module,
            "grads": {n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


@pytest.fixture(scope="module")
def two_layer_step():
    """fn(scope, arch) -> ``_compiled_step`` of the 2-layer flattened module with its guards' names ("guards"),
    compiled once a module: the parameter views test and the flat plan's guards test read the same compiled step."""
    done = {}

    def step(scope: str, arch: str) -> dict:
        if (scope, arch) not in done:
            guards = []
            done[scope, arch] = {**_compiled_step(2, scope, arch, guards), "guards": guards}
        return done[scope, arch]

    return step


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scope", SCOPES)
def test_a_compiled_step_returns_no_parameter_views(arch, scope, two_layer_step):
    """Views made inside the compiled graph and left on their modules would be graph outputs, regenerated and set
    back after every call (17 a BERT layer: a quarter of a compiled step's host time at BERT-base depth). Their
    count grew with the depth; now the graph's outputs do not, and the compiled step still computes the eager
    one's loss and gradients, and an eager forward of the compiled module afterwards makes its views again."""
    step = two_layer_step(scope, arch)
    (two,), loss, grads = step["outputs"], step["loss"], step["grads"]
    (four,) = _compiled_step(4, scope, arch)["outputs"]
    assert two == four, f"the compiled graph returns {four - two} more tensors with 2 more layers"
    eager = _module(True, scope, num_layers=2, **ARCHS[arch])
    eager.train()
    ref, _ = eager(host_facts(_batch(), unpadded=False))
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    for name, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item())
    module = step["module"]  # compiled, and it took its training step (forward and backward) above
    module.eval()
    eager.eval()
    ids = (_batch()["input_ids"], _batch()["attention_mask"])
    with torch.no_grad():  # straight to the model, as an evaluation callback calls it
        torch.testing.assert_close(module.model.encode(*ids), eager.model.encode(*ids), rtol=0, atol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scope", SCOPES)
def test_the_compiled_step_guards_none_of_the_flat_plans_entries(arch, scope, two_layer_step):
    """A traced ``materialize`` reads the layer's plan (split sizes, shapes, which module gets which view) as one
    constant (``flat._traced_plan``), not entry by entry: read entry by entry, every number and name became a guard
    that torch.compile evaluates before each call of the compiled step (3,012 of 3,801 guards at BERT-base depth;
    torch's one-shot guard latency 2.3 ms before, 0.9-1.5 ms after, docs/performance.md). The guards are what
    torch.compile's guard_filter_fn is shown (all kept) as it compiles the 2-layer step (``two_layer_step``); the
    compiled step still computes the eager step's loss."""
    step = two_layer_step(scope, arch)
    names = step["guards"]
    assert len(names) > 50, names  # the recorder saw the step's guards
    plan = [n for n in names if "._flat_" in n and "._flat_key" not in n]
    assert not plan, f"{len(plan)} guards on the flat plan's entries, e.g. {plan[:3]}"
    # one source per unit: which plan
    assert len({n for n in names if "._flat_key" in n}) == len(_units(step["module"]))
    eager = _module(True, scope, num_layers=2, **ARCHS[arch])
    eager.train()
    torch.testing.assert_close(step["loss"], eager(host_facts(_batch(), unpadded=False))[0], rtol=1e-6, atol=1e-6)
