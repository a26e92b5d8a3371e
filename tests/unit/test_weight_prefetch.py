"""The L2 weight prefetch of small decode steps (``engine/layers/weight_prefetch.py``,
``kernels/l2_prefetch.py``) on the CPU: its schedule, the model's points in the order the
step's kernels really read them, when it applies, the switches' parsing and the launcher's
refusals. ``tests/kernels/test_l2_prefetch.py`` runs it on a GPU (same bits, in a graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.models.qwen3 as qwen3
from engine.layers import kernel_switches
from engine.layers.pointwise import PointwiseOps
from engine.layers.weight_prefetch import PrefetchSchedule, point_tensors, prefetch_distance
from engine.loader.dummy import init_random_weights
from engine.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from kernels.l2_prefetch import MAX_RANGES, l2_prefetch, prefetch_lines
from tests.unit.test_model_compile import _caches, _config, _step


@pytest.mark.parametrize("distance", [1, 2, 3])
@pytest.mark.parametrize("num_points", [1, 5, 8])
def test_schedule_asks_each_point_once_and_distance_ahead(distance, num_points):
    schedule = PrefetchSchedule(num_points, distance)
    asked_at = {}
    for j in range(num_points):
        for p in schedule.due(j):
            assert p not in asked_at, f"point {p} asked twice"
            asked_at[p] = j
    assert sorted(asked_at) == list(range(num_points))
    for p, j in asked_at.items():
        assert j == max(0, p - distance), (p, j)


def test_schedule_refuses_distance_zero():
    with pytest.raises(ValueError, match="distance"):
        PrefetchSchedule(4, 0)


class _Recorder:
    """Stands in for WeightPrefetch: records its calls into ``events``."""

    def __init__(self, events, points, distance):
        self.events = events
        self.points = points
        self.schedule = PrefetchSchedule(len(points), distance)
        events.append(("built", len(points)))

    def at(self, point):
        self.events.append(("at", point, list(self.schedule.due(point))))

    def finish(self):
        self.events.append(("finish",))


def test_model_numbers_points_in_the_order_its_kernels_read_them(monkeypatch):
    """A 2-layer model's step with the prefetch forced on: every point's modules are asked for
    before they run, the points come in launch order (q/k/v, attention then o, gate/up, down)
    and the side stream is joined after the last layer."""
    model = Qwen3ForCausalLM(_config(), 512, "torch").eval()
    init_random_weights(model, 0, std=0.08)
    events = []
    monkeypatch.setattr(qwen3, "prefetch_distance", lambda x: 1)
    monkeypatch.setattr(qwen3, "WeightPrefetch", lambda points, d: _Recorder(events, points, d))
    names = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, mod in (("qkv", attn.qkv_proj), ("attn", attn.attn), ("o", attn.o_proj),
                          ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):  # fmt: skip
            names[mod] = f"{name}{i}"
            mod.register_forward_pre_hook(lambda m, args: events.append(("run", names[m])))
    ids, pos, meta = _step(torch.Generator().manual_seed(0), [1], [5])
    with torch.inference_mode():
        model(ids, pos, _caches(), meta)
    assert events[0] == ("built", 8)
    assert events[-1] == ("finish",)
    order = [e[1] if e[0] == "run" else f"at{e[1]}" for e in events[1:-1]]
    assert order == [
        "at0", "qkv0", "at1", "attn0", "o0", "at2", "gate_up0", "at3", "down0",
        "at4", "qkv1", "at5", "attn1", "o1", "at6", "gate_up1", "at7", "down1",
    ]  # fmt: skip
    recorder_points = [e for e in events if e[0] == "at"]
    assert [p for e in recorder_points for p in e[2]] == list(range(8))
    flat = [m for layer in model.model.layers for pt in layer.prefetch_points() for m in pt]
    assert [names[m] for m in flat] == ["qkv0", "o0", "gate_up0", "down0",
                                        "qkv1", "o1", "gate_up1", "down1"]  # fmt: skip


def test_a_sparse_mlp_layer_has_only_the_attention_points():
    layer = Qwen3DecoderLayer(_config(), PointwiseOps(False), "torch", False, mlp=nn.Identity())
    points = layer.prefetch_points()
    assert points == [[layer.self_attn.qkv_proj], [layer.self_attn.o_proj]]


def test_point_tensors_largest_first_and_at_most_the_launch_limit():
    mods = [nn.Linear(8, 4, bias=True), nn.Linear(16, 8, bias=True), nn.Linear(2, 2)]
    tensors = point_tensors(mods)
    assert len(tensors) == MAX_RANGES
    assert tensors[0] is mods[1].weight and tensors[1] is mods[0].weight
    sizes = [t.numel() for t in tensors]
    assert sizes == sorted(sizes, reverse=True)
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert point_tensors(mods, max_bytes=total) == tensors
    assert point_tensors(mods, max_bytes=total - 1) == []  # too big for L2: not prefetched


class _CudaLike:
    """A step's embeddings as :func:`prefetch_distance` sees them: a CUDA tensor of T rows."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, tokens):
        self.shape = (tokens, 8)


@pytest.mark.parametrize(
    "switch,tokens,capturing,compiling,expected",
    [
        (True, 1, True, False, 3),
        (True, 16, True, False, 3),
        (True, 17, True, False, None),  # not weight-bound
        (True, 1, False, False, None),  # eager: the warm-up (compiles the kernel), no prefetch
        (True, 1, True, True, None),  # torch.compile tracing
        (False, 1, True, False, None),
    ],
)
def test_applies_only_to_small_cuda_steps_under_capture(
    monkeypatch, switch, tokens, capturing, compiling, expected
):

    warmed = []
    monkeypatch.setattr(kernel_switches, "L2_PREFETCH", switch)
    monkeypatch.setattr(kernel_switches, "L2_PREFETCH_DISTANCE", 3)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    import kernels.l2_prefetch as l2

    monkeypatch.setattr(l2, "warm_up", warmed.append)
    assert prefetch_distance(_CudaLike(tokens)) == expected
    assert len(warmed) == (1 if switch and tokens <= 16 and not capturing and not compiling else 0)


def test_cpu_steps_never_prefetch(monkeypatch):
    monkeypatch.setattr(kernel_switches, "L2_PREFETCH", True)
    assert prefetch_distance(torch.zeros(1, 8)) is None  # no L2 to fill


@pytest.mark.parametrize("value,expected", [("1", 1), (" 3 ", 3), ("8", 8)])
def test_distance_variable(value, expected):
    env = {"QWEN_SERVE_L2_PREFETCH_DISTANCE": value}
    assert kernel_switches.prefetch_distance(env) == expected


@pytest.mark.parametrize("value", ["0", "9", "-1", "two", ""])
def test_distance_variable_refuses_other_values(value):
    with pytest.raises(ValueError, match="QWEN_SERVE_L2_PREFETCH_DISTANCE"):
        kernel_switches.prefetch_distance({"QWEN_SERVE_L2_PREFETCH_DISTANCE": value})


def test_launcher_refuses_what_it_cannot_fetch_and_skips_the_cpu():
    with pytest.raises(ValueError, match="at most"):
        l2_prefetch([torch.zeros(4)] * (MAX_RANGES + 1))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch([torch.zeros(4, 4).t()])
    l2_prefetch([torch.zeros(4), torch.zeros(0)])  # CPU tensors: nothing to launch, no error
    with pytest.raises(ValueError, match="program"):
        l2_prefetch([torch.zeros(4)], programs=0)
    assert prefetch_lines(torch.zeros(33, dtype=torch.bfloat16)) == 1
    assert prefetch_lines(torch.zeros(65, dtype=torch.bfloat16)) == 2


def test_server_knows_the_distance_variable():
    from server.__main__ import build_parser, unknown_env

    env = {"QWEN_SERVE_L2_PREFETCH": "1", "QWEN_SERVE_L2_PREFETCH_DISTANCE": "2"}
    assert unknown_env(build_parser(), env) == []
