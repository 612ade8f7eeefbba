"""The benchmarks' PyTorch twin computes what kiln's step computes, so that their speeds compare:
at the small-step benchmark's shapes (nanoGPT's CPU recipe, the tiny config's model), from the
same weights on the same batches, the losses of the first steps agree to float32 rounding, and a
twin with one parameter perturbed does not (the check can fail)."""

from __future__ import annotations

import sys

import numpy as np

from tests.conftest import REPO, needs

torch = needs("torch")
sys.path.insert(0, str(REPO / "benchmarks"))
from small_step_bench import shapes  # noqa: E402
from train_bench import check_twins_agree, make_batches, torch_twin  # noqa: E402


def test_torch_twin_matches_kiln_step_at_the_small_shapes():
    for name, (model, cfg) in shapes(steps=30).items():
        batches = make_batches(model, cfg, 2)
        assert check_twins_agree(model, cfg, batches, steps=2) < 1e-4, name


def test_a_perturbed_twin_disagrees():
    model, cfg = shapes(steps=30)["nanogpt"]
    batch = torch.from_numpy(make_batches(model, cfg, 1)[0].astype(np.int64))
    first = float(torch_twin(model, cfg, compile_model=False)(0, batch))
    assert abs(float(torch_twin(model, cfg, compile_model=False)(0, batch)) - first) < 1e-6  # deterministic
    perturbed = torch_twin(model, cfg, compile_model=False)
    optimizer = next(c.cell_contents for c in perturbed.__closure__
                     if isinstance(c.cell_contents, torch.optim.Optimizer))  # the step closure's AdamW
    with torch.no_grad():
        optimizer.param_groups[0]["params"][0].add_(0.05)  # the first matrix, before the first step
    assert abs(float(perturbed(0, batch)) - first) > 1e-4
