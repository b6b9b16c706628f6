"""Property-based round trips of every compressor's payloads, across gradient dtypes and sizes.

Every rank parses the other ranks' payloads from bytes, knowing only the tensor's length and the
compressor's configuration; a payload written in one dtype and parsed as another decodes to
garbage without an error (the bf16 top-k payload [5, 6, 7, 8] once decoded as
[8e-45, 2052, 0, 131356]). For every compressor config, every gradient dtype and many sizes, the
payload rebuilt from its wire form must be the payload that was sent, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors import CombineMode, Compressor, ErrorFeedback, SparsePayload, TopKCompressor

CONF = Path(__file__).resolve().parents[2] / "lgc" / "conf" / "compressor"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compressor_nodes() -> dict[str, dict]:
    """Every compressor config that builds an lgc Compressor (hook states such as LGC are tested elsewhere)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    nodes = {}
    with initialize_config_module("lgc.conf", version_base="1.3"):
        for path in sorted(CONF.glob("*.yaml")):
            cfg = compose("train", overrides=[f"compressor={path.stem}", "logger=none"])
            node = OmegaConf.to_container(cfg.compressor, resolve=True)
            if node["_target_"].startswith("lgc.compressors"):
                nodes[path.stem] = node
    return nodes


NODES = _compressor_nodes()


def _build(name: str) -> Compressor:
    from lgc.methods import build_compressor

    built = build_compressor(dict(NODES[name]))
    assert isinstance(built, Compressor)
    return built


def _gradient(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel).flip(0)[torch.randperm(numel, generator=g)]
    values[torch.rand(numel, generator=g) < 0.1] = 0.0  # exact zeros (ReLU networks have many)
    return values.to(dtype)


def _rebuilt(compressor: Compressor, payload):
    if compressor.combine is CombineMode.SUM:
        (wire_tensor,) = payload.tensors()
        return compressor.payload_from_sum(wire_tensor.clone(), payload)
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    return compressor.payload_from_wire(wire.clone(), payload.numel)


def test_every_compressor_config_is_covered():
    expected = {"topk", "dgc", "sbc", "redsync", "random_block", "qsgd", "terngrad", "signsgd", "none", "fp16"}
    assert expected <= set(NODES)


@pytest.mark.parametrize("name", sorted(NODES))
@settings(max_examples=20, deadline=None)
@given(numel=st.integers(1, 3000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_payloads_survive_the_wire_in_every_dtype(name, numel, dtype, seed):
    compressor = _build(name)
    tensor = _gradient(numel, dtype, seed)
    compressor.attach_parameters({"w": _gradient(numel, dtype, seed + 1)})  # DGC's weight decay reads them
    original = tensor.clone()
    payload = compressor.compress(tensor, "w")
    rebuilt = _rebuilt(compressor, payload)
    sent, parsed = payload.tensors(), rebuilt.tensors()
    assert [(t.dtype, t.shape) for t in parsed] == [(t.dtype, t.shape) for t in sent]
    for a, b in zip(sent, parsed, strict=True):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    decoded, decoded_again = compressor.decompress(payload), compressor.decompress(rebuilt)
    # fp32, or the gradient's own dtype for dense sums (``none``: exactly what plain DDP would sum).
    assert decoded.dtype in (torch.float32, dtype) and decoded.numel() == numel
    assert torch.equal(decoded, decoded_again)
    assert bool(torch.isfinite(decoded).all())
    if not isinstance(compressor, ErrorFeedback):
        assert torch.equal(tensor, original), "a compressor without error feedback changed its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_half_precision_topk_payload_decodes_to_its_values(dtype):
    # The report's case: values [5, 6, 7, 8] of a bf16 gradient.
    compressor = TopKCompressor(density=0.5)
    payload = compressor.compress(torch.tensor([5.0, 0.0, 6.0, 0.0, 7.0, 0.0, 8.0, 0.0], dtype=dtype), "w")
    parsed = compressor.payload_from_wire(payload.to_wire(), 8)
    assert sorted(compressor.decompress(parsed)[[0, 2, 4, 6]].tolist()) == [5.0, 6.0, 7.0, 8.0]
    assert payload.nbytes == 4 * 8  # fp32 values and int32 indices whatever the gradient's dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
def test_error_feedback_keeps_fp32_residuals_and_the_rounding_of_half_values(dtype, value_dtype):
    ef = ErrorFeedback(TopKCompressor(density=0.1, value_dtype=value_dtype))
    total_in = torch.zeros(1000)
    total_sent = torch.zeros(1000)
    for step in range(20):
        g = _gradient(1000, dtype, step)
        corrected = g.float() + ef.residuals.get("w", torch.zeros(1000))
        payload = ef.compress(g, "w")
        assert isinstance(payload, SparsePayload) and payload.values.dtype == getattr(torch, value_dtype)
        sent = ef.decompress(ef.payload_from_wire(payload.to_wire(), 1000))
        residual = ef.residuals["w"]
        assert residual.dtype == torch.float32
        # The invariant of error feedback, exactly, in fp32: what was sent plus what is kept.
        assert torch.equal(sent + residual, corrected)
        total_in += g.float()
        total_sent += sent
    torch.testing.assert_close(total_sent + ef.residuals["w"], total_in)


def test_every_compressor_rebuilds_its_payload_from_the_wire_with_one_signature():
    import inspect

    import lgc.compressors as compressors
    from lgc.compressors import NoneCompressor

    classes = [c for c in vars(compressors).values() if isinstance(c, type) and issubclass(c, Compressor)]
    assert len(classes) >= 14
    for cls in classes:
        parameters = inspect.signature(cls.payload_from_wire).parameters
        assert list(parameters) == ["self", "wire", "numel", "key"], cls.__name__
        assert parameters["key"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["key"].default is None
    # The dense wire says its dtype by its length, except where two dtypes share one.
    none = NoneCompressor()
    for dtype in (torch.float32, torch.float64):
        x = torch.arange(5, dtype=dtype)
        assert torch.equal(none.payload_from_wire(none.compress(x, "w").to_wire(), 5).values, x)
    with pytest.raises(ValueError, match="2 bytes per entry does not say its dtype"):
        none.payload_from_wire(none.compress(torch.ones(5, dtype=torch.bfloat16), "w").to_wire(), 5)
