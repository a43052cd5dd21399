"""``train.compile`` on CUDA: the generated dense LM's and Wan DiT's blocks compiled with inductor (Triton kernels
for the GPU, ``runtime.parallel.compile.apply_compile``), forward + backward in fp32 against eager with the same
weights, and what dynamo saw: the graph-break count per family (none allowed for these two; the allowed kinds of
the other families are tests/gpu_readiness/test_compile.py's, on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CUDA, on, rel

pytestmark = pytest.mark.gpu

TOL = 1e-4  # inductor fuses and reorders fp32 reductions (1e-5 on CPU; TF32 stays off)


def _model_and_inputs(family: str) -> tuple[torch.nn.Module, dict]:
    from tests.gpu_readiness.bf16 import _inputs, _model

    return _model(family).to(CUDA), on(_inputs(family, 1, 0))


def _loss(family: str, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    if family == "dit":
        return model(**inputs)[0].float().square().mean()
    return model(**inputs).loss.float()


@pytest.mark.parametrize("family", ["dense", "dit"])
def test_compiled_blocks_match_eager_without_graph_breaks(family: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runtime.parallel.compile import apply_compile

    eager, inputs = _model_and_inputs(family)
    compiled, _ = _model_and_inputs(family)
    compiled.load_state_dict(eager.state_dict())
    loss = _loss(family, eager, inputs)
    loss.backward()
    torch._dynamo.reset()
    counters.clear()
    blocks = apply_compile(compiled, backend="inductor")
    got = _loss(family, compiled, inputs)
    got.backward()
    breaks = {str(reason): int(n) for reason, n in counters["graph_break"].items()}
    graphs = int(counters["stats"]["unique_graphs"])
    print(f"{family}: {len(blocks)} blocks compiled, {graphs} graphs, {sum(breaks.values())} graph breaks {breaks}")
    assert blocks and graphs >= 1
    assert not breaks, breaks
    assert rel(got, loss) <= TOL
    reference = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        if p.grad is not None:
            assert rel(p.grad, reference[name].grad) <= TOL, (name, rel(p.grad, reference[name].grad))
