"""The capacity planner (training/capacity.py, `kiln capacity`): the real train step compiled on
simulated devices, its per-device numbers consistent with the shardings and with kiln's FLOP count."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from training.capacity import fits, how_many, report, table
from training.config import ModelConfig, TrainConfig, flops_per_token
from training.model import init_params, param_count

REPO = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=64)
TRAIN = TrainConfig(batch_size=8, steps=10, warmup=1)


@pytest.fixture(scope="module")
def plans() -> dict:
    """dp, fsdp, fsdp with full remat and fsdp with train.ema on 4 simulated devices, in one fresh JAX process."""
    script = textwrap.dedent(f"""
        import json, os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        os.environ["JAX_PLATFORMS"] = "cpu"
        from training.capacity import plan
        from training.config import MeshConfig, ModelConfig, TrainConfig
        model = ModelConfig.model_validate_json({MODEL.model_dump_json()!r})
        train = TrainConfig.model_validate_json({TRAIN.model_dump_json()!r})
        out = {{}}
        for name, strategy, remat, ema in (("dp", "dp", "none", None), ("fsdp", "fsdp", "none", None),
                                           ("fsdp_full", "fsdp", "full", None), ("fsdp_ema", "fsdp", "none", 0.999)):
            cfg = train.model_copy(update={{"mesh": MeshConfig(strategy=strategy), "remat": remat, "ema": ema}})
            out[name] = plan(model, cfg)
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bytes_per_device_follow_the_shardings(plans):
    params = jax.eval_shape(lambda: init_params(MODEL, jax.random.PRNGKey(0)))
    leaves = jax.tree_util.tree_leaves(params)
    n = param_count(params)
    # fsdp splits every matrix over the 4 devices (each of this model's has a dimension 4 divides);
    # the norm weights, vectors, stay whole
    matrices = sum(math.prod(a.shape) for a in leaves if a.ndim == 2)
    vectors = n - matrices
    dp, fsdp = plans["dp"], plans["fsdp"]
    assert dp["devices"] == fsdp["devices"] == 4 and dp["param_count"] == n
    assert dp["param_bytes"] == 4 * n
    assert fsdp["param_bytes"] == 4 * (matrices // 4 + vectors)
    for p in (dp, fsdp):
        assert p["gradient_bytes"] == p["param_bytes"]
        # AdamW's two moments mirror the parameters; its counts are a few scalars
        assert 2 * p["param_bytes"] <= p["optimizer_bytes"] <= 2 * p["param_bytes"] + 64
        assert p["argument_bytes"] >= p["param_bytes"] + p["optimizer_bytes"]
        assert p["temp_bytes"] > 0
    # train.ema's average is one more copy of the parameters, laid out as they are
    ema = plans["fsdp_ema"]
    assert ema["ema_bytes"] == fsdp["param_bytes"] and fsdp["ema_bytes"] == 0
    assert ema["argument_bytes"] - fsdp["argument_bytes"] == fsdp["param_bytes"]
    assert "moving average" in table({**ema, "total_bytes": 0, "memory_fraction": 0.9, "mfu": 0.4, "fit": []})


def test_flops_per_step_and_remat(plans):
    fsdp = plans["fsdp"]
    assert fsdp["flops_per_step"] == pytest.approx(flops_per_token(MODEL) * TRAIN.batch_size * MODEL.seq_len / 4)
    # the compiled program's own count agrees with 6N + attention to within what each leaves out
    assert fsdp["compiler_flops"] == pytest.approx(fsdp["flops_per_step"], rel=0.25)
    full = plans["fsdp_full"]
    assert full["remat"] == "full" and full["temp_bytes"] < fsdp["temp_bytes"]
    assert full["compiler_flops"] > fsdp["compiler_flops"]  # the forward again, in the backward pass


def test_fit_and_step_time_from_the_numbers(plans):
    r = report(plans["dp"], ["h100-80gb", "tpu-v5e"], mfu=0.5)
    h100 = r["fit"][0]
    assert h100["fits"] and h100["step_seconds"] == pytest.approx(r["flops_per_step"] / (989e12 * 0.5))
    huge = {**plans["dp"], "temp_bytes": 70 * 2**30}  # more than JAX's 75% of an H100, less than all of it
    assert not fits(huge, "h100-80gb")["fits"] and fits(huge, "h100-80gb", memory_fraction=1.0)["fits"]
    assert "does NOT fit" in table(report(huge, ["h100-80gb"], 0.4))
    assert table(r).startswith(f"{how_many(r['param_count'])} parameters, ")
    assert [how_many(n) for n in (1_235_814_400, 124_000_000, 51_088, 640)] == ["1.24B", "124M", "51.1K", "640"]
    with pytest.raises(ValueError, match="unknown device"):
        fits(plans["dp"], "h100")


def test_a_plan_asked_again_reads_its_step_from_the_compilation_cache(tmp_path, monkeypatch):
    """`kiln capacity`'s planning process keeps what it compiles (training/compile_cache.py): the
    same plan again reads the step back and reports the same numbers."""
    from flows.capacity import planned

    monkeypatch.setenv("KILN_COMPILE_CACHE", str(tmp_path / "cache"))
    first, again = planned(MODEL, TRAIN, devices=2), planned(MODEL, TRAIN, devices=2)
    assert first.pop("compiled_programs_read") == 0 and again.pop("compiled_programs_read") >= 1
    assert again == first and first["temp_bytes"] > 0
    assert any((tmp_path / "cache").iterdir())


def test_a_batch_the_devices_cannot_split_names_the_devices_flag():
    from flows.capacity import planned

    with pytest.raises(RuntimeError, match=r"does not split .* over 3 data-parallel devices.*--devices N"):
        planned(MODEL, TRAIN.model_copy(update={"mesh": TRAIN.mesh.model_copy(update={"strategy": "dp"})}), devices=3)


def test_kiln_capacity_plans_a_phase_whose_train_section_changes_the_batch(tmp_path):
    """A phase (a cooldown, say) may train with another batch, mesh or remat than `train`: `--step
    train/<phase>` plans it, and says which step it planned and which others there are. Before,
    only `train` could be planned."""
    import yaml

    from flows.capacity import capacity, print_report

    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["phases"] = {"wide": {"steps": 10, "train": {"batch_size": 64}}}
    config = tmp_path / "phased.yaml"
    config.write_text(yaml.safe_dump(raw))
    base = capacity(str(config), devices=1, targets=["h100-80gb"])
    wide = capacity(str(config), devices=1, targets=["h100-80gb"], step="train/wide")
    assert base["step"] == "train" and wide["step"] == "train/wide" and wide["train_steps"] == ["train", "train/wide"]
    assert wide["flops_per_step"] == 4 * base["flops_per_step"]  # a batch of 64 against tiny_cpu's 16
    assert wide["temp_bytes"] > base["temp_bytes"]  # the activations of four times the sequences
    assert wide["param_bytes"] == base["param_bytes"]
    print_report(wide, "phased.yaml", as_json=False)
    with pytest.raises(ValueError, match=r"has no train step 'train/cool'; its train steps: train, train/wide"):
        capacity(str(config), devices=1, step="train/cool")


def test_kiln_capacity_plans_the_sft_and_dpo_steps(tmp_path):
    """`--step sft` and `--step dpo` plan post-training's steps: the same model with their own
    train sections and objectives, DPO's rows a chosen and a rejected sequence each, so at the same
    batch its step computes on twice SFT's tokens, by the compiled program's own count too. Before,
    only pretraining's steps could be planned, though an 8B SFT or DPO is where the memory runs out."""
    from flows.capacity import capacity, print_report

    sets = ["posttrain.sft.train.batch_size=8", "posttrain.dpo.train.batch_size=8"]
    config = str(REPO / "configs" / "posttrain_cpu.yaml")
    base, sft, dpo = (capacity(config, devices=1, targets=["h100-80gb"], sets=sets, step=s)
                      for s in ("train", "sft", "dpo"))
    assert [sft["objective"], dpo["objective"], base["objective"]] == ["sft", "dpo", "next_token"]
    assert dpo["train_steps"] == ["train", "sft", "dpo"]
    assert sft["param_bytes"] == dpo["param_bytes"] == base["param_bytes"]  # the final model, trained on
    assert dpo["tokens_per_step"] == 2 * sft["tokens_per_step"] == 2 * 8 * sft["seq_len"]
    assert 1.8 < dpo["compiler_flops"] / sft["compiler_flops"] < 2.2, (dpo["compiler_flops"], sft["compiler_flops"])
    assert dpo["temp_bytes"] > sft["temp_bytes"]  # the activations of both sequences of each pair
    remat = capacity(config, devices=1, targets=["h100-80gb"], sets=[*sets, "posttrain.dpo.train.remat=full"],
                     step="dpo")
    assert remat["remat"] == "full" and remat["temp_bytes"] < 0.5 * dpo["temp_bytes"]  # before, refused
    # DPO's reference scores the pairs before the first step, a microbatch at a time
    assert sft["reference_bytes"] == base["reference_bytes"] == 0 < dpo["reference_bytes"] <= dpo["total_bytes"]
    micro = capacity(config, devices=1, targets=["h100-80gb"], sets=[*sets, "posttrain.dpo.train.microbatches=4"],
                     step="dpo")
    assert micro["reference_bytes"] < 0.5 * dpo["reference_bytes"], (micro["reference_bytes"], dpo["reference_bytes"])
    lora = capacity(config, devices=1, targets=["h100-80gb"], sets=[*sets, "posttrain.sft.train.lora={rank: 4}"],
                    step="sft")
    assert lora["optimizer_bytes"] < sft["optimizer_bytes"] / 10  # only the adapters' moments
    print_report(dpo, "posttrain_cpu.yaml", as_json=False)
    with pytest.raises(ValueError, match=r"has no train step 'dpo'; its train steps: train, sft$"):
        capacity(config, devices=1, sets=["posttrain.dpo=null"], step="dpo")
